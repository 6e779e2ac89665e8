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
from .ops import rms_norm, sigmoid, softmax

F32 = np.float32


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
    t = mixes.shape[0]
    hc = math.isqrt(w.base.shape[0] + 1) - 1  # (2 + hc) * hc mixes = (hc + 1)^2 - 1
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


def collapse(x: np.ndarray, pre: np.ndarray) -> np.ndarray:
    """Streams x (T, hc, D) weighted by pre (T, hc) -> one block input (T, D)."""
    return np.einsum("th,thd->td", pre, x, dtype=F32)


def hc_pre(
    x: np.ndarray, w: HcWeights, sinkhorn_iters: int, hc_eps: float, norm_eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (T, hc, D) -> (block input (T, D), post (T, hc), comb (T, hc, hc))."""
    mixes = matmul(w.fn, _flat_norm(x, norm_eps))  # (T, (2+hc)*hc)
    pre, post, comb = split_mixes(mixes, w, sinkhorn_iters, hc_eps)
    return collapse(x, pre), post, comb


def hc_post(x: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """Streams x (T, hc, D), block output y (T, D) -> new streams (T, hc, D)."""
    mixed = np.matmul(comb.transpose(0, 2, 1), x)  # (T, hc, D): sum_j comb[j, k] x[j]
    return post[:, :, None] * y[:, None, :] + mixed


def hc_head(x: np.ndarray, w: HcHeadWeights, hc_eps: float, norm_eps: float) -> np.ndarray:
    """Final collapse of the streams: x (T, hc, D) -> (T, D)."""
    mixes = matmul(w.fn, _flat_norm(x, norm_eps))  # (T, hc)
    pre = sigmoid(mixes * w.scale[0] + w.base) + F32(hc_eps)
    return np.einsum("th,thd->td", pre, x, dtype=F32)
