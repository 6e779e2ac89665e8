"""Elementwise and reduction helpers shared by the model's blocks.

Owns: RMS norms, activations, softmax and the deterministic top-k used by routing and the
indexer. Everything is float32 numpy in, float32 numpy out; nothing here knows about
weights, checkpoints or session state.
"""

from __future__ import annotations

import numpy as np

from ..errors import InternalError
from ..kernels import backend_name

F32 = np.float32
_FUSED = [True]  # `set_fused`: off runs the numpy steps under the fast backend too (benchmarks)


def set_fused(on: bool) -> None:
    """Let `fused` say yes (the default) or never (bench/trunk_overhead.py times both: same bits)."""
    _FUSED[0] = bool(on)


def fused(*arrays: np.ndarray | None) -> bool:
    """Whether the trunk's small steps run as `kernels.trunkops`' numba functions (the numpy code's
    bits, without its per-call cost): under the fast kernel backend, on float32 arrays."""
    return _FUSED[0] and backend_name() == "fast" and all(a is None or a.dtype == F32 for a in arrays)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """x (..., N) -> x / rms(x) * weight, the RMS taken over the last axis."""
    if fused(x, weight) and (weight is None or weight.shape == x.shape[-1:]) and x.size:
        from ..kernels import trunkops

        return trunkops.rms_norm(x, weight, eps)
    return rms_norm_numpy(x, weight, eps)


def rms_norm_numpy(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """`rms_norm` in numpy: the definition `kernels.trunkops.rms_norm` follows bit for bit."""
    # np.mean's own steps (float32 pairwise sum, then a division by the intp count), without its
    # Python wrappers: same bits, a few µs less on each of a token's ~30 norms
    ms = np.add.reduce(np.square(x, dtype=F32), axis=-1, keepdims=True, dtype=F32)
    np.true_divide(ms, np.intp(x.shape[-1]), out=ms, casting="unsafe")
    if ms.size == 1:  # one row (a decode step): the same float32 steps on a scalar, not (1, 1) arrays
        ms = ms.reshape(-1)[0]
    y = x * (F32(1.0) / np.sqrt(ms + F32(eps)))
    return y if weight is None else y * weight


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Overflow-free logistic function: 1 / (1 + e) for x >= 0, e / (1 + e) below, e = exp(-|x|).

    In place on its own temporaries (three arrays, not nine: the MoE calls it on every
    expert's (n, inter) gate)."""
    x = np.asarray(x, dtype=F32)
    e = np.empty_like(x)
    np.abs(x, out=e)
    np.negative(e, out=e)
    np.exp(e, out=e)
    num = np.where(x >= 0, F32(1.0), e)
    e += F32(1.0)
    return np.divide(num, e, out=num)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) as x / (1 + e^-x), float32, in four passes over one temporary (the MoE's
    (n, inter) gate: 256 x 2048 went 2.9 -> 0.46 ms, against `sigmoid`'s seven passes). Where
    e^-x overflows (x below about -88) the quotient is -0, the limit."""
    e = np.negative(x, dtype=F32)
    with np.errstate(over="ignore"):
        np.exp(e, out=e)
    e += F32(1.0)
    return np.divide(x, e, out=e)


def sqrt_softplus(x: np.ndarray) -> np.ndarray:
    """The V4 router score: sqrt(log(1 + e^x)), computed without overflow."""
    return np.sqrt(np.logaddexp(F32(0.0), x)).astype(F32, copy=False)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax along `axis`; entries at -inf get weight 0 (at least one must be finite)."""
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def topk_lowest_index(scores: np.ndarray, k: int) -> np.ndarray:
    """scores (T, N) -> (T, k) indices of the k largest per row, in ascending index order.

    Ties at the k-th value go to the lower index, so the choice does not depend on the sort
    algorithm or thread count. Requires 1 <= k <= N.
    """
    t, n = scores.shape
    if not 1 <= k <= n:
        raise InternalError(f"top-{k} of {n} scores per row: need 1 <= k <= {n}")
    if k == n:
        return np.broadcast_to(np.arange(n), (t, n)).copy()
    kth = np.partition(scores, n - k, axis=-1)[:, n - k : n - k + 1]
    above = scores > kth
    tied = scores == kth
    need = k - above.sum(axis=-1, keepdims=True)
    take = above | (tied & (np.cumsum(tied, axis=-1) <= need))
    return np.nonzero(take)[1].reshape(t, k)
