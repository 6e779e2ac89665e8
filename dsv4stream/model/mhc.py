"""Manifold-constrained hyper-connections (mHC): V4's residual stream.

Owns: turning the hc_mult residual streams (T, hc, D) into one block input (`hc_pre`), and
folding the block output back into the streams (`hc_post`), plus the head's own final
collapse (`hc_head`). It does not own the blocks themselves.

Facts this follows: the RMS norm runs over the whole flattened hc*D vector (no weight,
eps = rms_norm_eps); pre = sigmoid + hc_eps; post = 2*sigmoid; comb starts as a row
softmax (+hc_eps), is column-normalised, then gets hc_sinkhorn_iters-1 more row/column
passes; the streams are mixed by comb transposed: new[k] = post[k]*y + sum_j comb[j,k]*x[j].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..kernels import QWeight, backend_name, matmul
from .ops import fused, rms_norm, sigmoid, softmax

F32 = np.float32
MAX_HC = 8  # `kernels.trunkops` and `kernels.sinkhorn` sum fewer terms than this one by one, as numpy does


@dataclass(frozen=True)
class HcWeights:
    fn: QWeight  # ((2 + hc) * hc, hc * D)
    base: np.ndarray  # ((2 + hc) * hc,) float32
    scale: np.ndarray  # (3,) float32: pre, post, comb


@dataclass(frozen=True)
class HcHeadWeights:
    fn: QWeight  # (hc, hc * D)
    base: np.ndarray  # (hc,)
    scale: np.ndarray  # (1,)


def _flat_norm(x: np.ndarray, eps: float) -> np.ndarray:
    t = x.shape[0]
    return rms_norm(x.reshape(t, -1), None, eps)


def _fast_sinkhorn(hc: int):
    """The numba Sinkhorn (`kernels.sinkhorn`, the loop below with the same bits) where the fast
    kernels run and it applies, else None."""
    if backend_name() != "fast":
        return None
    from ..kernels import sinkhorn

    return sinkhorn.sinkhorn if hc < sinkhorn.MAX_HC else None


def split_mixes(
    mixes: np.ndarray, w: HcWeights, sinkhorn_iters: int, hc_eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """mixes (T, (2+hc)*hc) -> (pre (T, hc), post (T, hc), comb (T, hc, hc) after Sinkhorn)."""
    hc = math.isqrt(w.base.shape[0] + 1) - 1  # (2 + hc) * hc mixes = (hc + 1)^2 - 1
    if hc < MAX_HC and fused(mixes, w.base, w.scale) and w.base.flags.c_contiguous and w.scale.flags.c_contiguous:
        from ..kernels import trunkops  # numba, like the fast backend

        return trunkops.split_mixes(mixes, w.scale, w.base, hc, sinkhorn_iters, hc_eps)
    return split_mixes_numpy(mixes, w, sinkhorn_iters, hc_eps)


def split_mixes_numpy(
    mixes: np.ndarray, w: HcWeights, sinkhorn_iters: int, hc_eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`split_mixes` in numpy (with `kernels.sinkhorn`'s passes under the fast backend): the
    definition `kernels.trunkops.split_mixes` follows bit for bit."""
    t = mixes.shape[0]
    hc = math.isqrt(w.base.shape[0] + 1) - 1
    pre = sigmoid(mixes[:, :hc] * w.scale[0] + w.base[:hc]) + F32(hc_eps)
    post = F32(2.0) * sigmoid(mixes[:, hc : 2 * hc] * w.scale[1] + w.base[hc : 2 * hc])
    logits = (mixes[:, 2 * hc :] * w.scale[2] + w.base[2 * hc :]).reshape(t, hc, hc)
    comb = softmax(logits, axis=-1) + F32(hc_eps)
    fast = _fast_sinkhorn(hc)
    if fast is not None:
        return pre, post, fast(np.ascontiguousarray(comb), sinkhorn_iters, F32(hc_eps))
    comb = comb / (comb.sum(axis=-2, keepdims=True) + F32(hc_eps))
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + F32(hc_eps))
        comb = comb / (comb.sum(axis=-2, keepdims=True) + F32(hc_eps))
    return pre, post, comb


def collapse(x: np.ndarray, pre: np.ndarray, norm: np.ndarray | None = None, eps: float = 0.0) -> np.ndarray:
    """Streams x (T, hc, D) weighted by pre (T, hc) -> one block input (T, D); with `norm`,
    `rms_norm(., norm, eps)` of it (one numba call for both under the fast backend)."""
    if fused(x, pre, norm) and (norm is None or norm.shape == x.shape[-1:]):
        from ..kernels import trunkops

        return trunkops.collapse(x, pre, norm, eps)
    h = collapse_numpy(x, pre)
    return h if norm is None else rms_norm(h, norm, eps)


def collapse_numpy(x: np.ndarray, pre: np.ndarray) -> np.ndarray:
    """`collapse` in numpy: the definition `kernels.trunkops.collapse` follows bit for bit."""
    return np.einsum("th,thd->td", pre, x, dtype=F32)


def hc_pre(
    x: np.ndarray, w: HcWeights, sinkhorn_iters: int, hc_eps: float, norm_eps: float, norm: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (T, hc, D) -> (block input (T, D), post (T, hc), comb (T, hc, hc)); with `norm`, the block
    input RMS-normed by that weight (`collapse`)."""
    mixes = matmul(w.fn, _flat_norm(x, norm_eps))  # (T, (2+hc)*hc)
    pre, post, comb = split_mixes(mixes, w, sinkhorn_iters, hc_eps)
    return collapse(x, pre, norm, norm_eps), post, comb


def hc_post(x: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """Streams x (T, hc, D), block output y (T, D) -> new streams (T, hc, D):
    new[k] = post[k] y + sum_j comb[j, k] x[j] (V4's and V4.1's)."""
    if fused(x, y, post, comb) and x.shape[0]:
        from ..kernels import trunkops

        return trunkops.hc_post(x, y, post, comb)
    return hc_post_numpy(x, y, post, comb)


def hc_post_numpy(x: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """`hc_post` in numpy: the definition `kernels.trunkops.hc_post` follows bit for bit."""
    mixed = np.matmul(comb.transpose(0, 2, 1), x)  # (T, hc, D): sum_j comb[j, k] x[j]
    return post[:, :, None] * y[:, None, :] + mixed


def hc_head(x: np.ndarray, w: HcHeadWeights, hc_eps: float, norm_eps: float) -> np.ndarray:
    """Final collapse of the streams: x (T, hc, D) -> (T, D)."""
    mixes = matmul(w.fn, _flat_norm(x, norm_eps))  # (T, hc)
    pre = sigmoid(mixes * w.scale[0] + w.base) + F32(hc_eps)
    return np.einsum("th,thd->td", pre, x, dtype=F32)
