"""Quantise-dequantise (QDQ) of activations, as DeepSeek-V4.1 does in its forward pass.

Owns: the three activation grids of V4.1 and the `Numerics` choice that says whether they
are applied. Each function maps float32 values onto a low-precision grid and back to float32
(the values stay float32; only the set of values they can take shrinks). Nothing here knows
about weights, layers or state.

The grids (from DeepSeek's kernels, checked against the torch ports of them):
- `fp8_qdq`: E4M3 with one power-of-two scale per `block` (32) values along the last axis,
  s = 2^ceil(log2(amax * fl(1/448))) with amax floored at 1e-4; x/s is clamped to +-448 and
  rounded to nearest even. Every FP8/FP4 matmul's input and the window KV go through it.
- `fp4_qdq_e8m0`: E2M1 with one power-of-two scale per 32 values, amax floored at 6*2^-126,
  s = 2^ceil(log2(amax * fl(1/6))). The indexer's query and keys.
- `fp4_qdq_e4m3`: E2M1 with one E4M3 scale per 16 values, s = e4m3(amax / 6), amax floored at
  6*2^-9. The compressed KV rows.
`fl(1/q)` is 1/q rounded to float32 (the kernels multiply by that constant; dividing by q would
round some amax values to the other power of two). Round-to-nearest-even to E4M3 / E2M1 comes
from ml_dtypes' casts, the same rule as the hardware conversions.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ...kernels import backend_name

F32 = np.float32
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
_FP8_MAX, _FP4_MAX = F32(448.0), F32(6.0)
_INV_FP8_MAX, _INV_FP4_MAX = F32(1.0) / _FP8_MAX, F32(1.0) / _FP4_MAX


@dataclass(frozen=True)
class Numerics:
    """Which of V4.1's quantisation points run.

    official: activation QDQ before every FP8/FP4 matmul, FP8 window KV, FP4 compressed KV and
    indexer q/k, as the released model computes. fp32: none of them; weights are still exactly
    their dequantised values, so the two differ only by the activation grids.
    """

    name: str

    @property
    def quantise(self) -> bool:
        return self.name == "official"


OFFICIAL = Numerics("official")
FP32 = Numerics("fp32")
NUMERICS = {n.name: n for n in (OFFICIAL, FP32)}


def _pow2_ceil(x: np.ndarray) -> np.ndarray:
    """2^ceil(log2(x)) for positive normal float32 x, exactly (exponent bits, +1 if any mantissa)."""
    bits = np.asarray(x, dtype=F32).view(np.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)
    return (e.astype(np.int32) << 23).view(F32)


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    if x.shape[-1] % block:
        raise ValueError(f"QDQ in blocks of {block} needs a last axis that is a multiple of it, found {x.shape}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fp8_qdq(x: np.ndarray, block: int = 32) -> np.ndarray:
    """x (..., N) float32 -> the nearest E4M3 values under per-`block` power-of-two scales (float32)."""
    xb = _blocks(x, block)
    amax = np.maximum(np.max(np.abs(xb), axis=-1, keepdims=True), F32(1e-4))
    s = _pow2_ceil(amax * _INV_FP8_MAX)
    q = np.clip(xb / s, -_FP8_MAX, _FP8_MAX).astype(_E4M3).astype(F32)
    return (q * s).reshape(np.shape(x))


def act_qdq(x: np.ndarray) -> np.ndarray:
    """`fp8_qdq(x, 32)`, the grid every FP8 / FP4 linear's input meets, through the numba kernel
    (`kernels.qdq`, the same bits, about 10x faster at one token) where the fast kernels run."""
    if backend_name() == "fast":
        from ...kernels.qdq import fp8_qdq_rows

        got = fp8_qdq_rows(x)
        if got is not None:
            return got
    return fp8_qdq(x, 32)


def fp4_qdq_e8m0(x: np.ndarray, block: int = 32) -> np.ndarray:
    """x (..., N) -> nearest E2M1 values under per-`block` power-of-two scales (the indexer's grid)."""
    xb = _blocks(x, block)
    amax = np.maximum(np.max(np.abs(xb), axis=-1, keepdims=True), F32(6.0 * 2.0**-126))
    s = _pow2_ceil(amax * _INV_FP4_MAX)
    q = np.clip(xb / s, -_FP4_MAX, _FP4_MAX).astype(_E2M1).astype(F32)
    return (q * s).reshape(np.shape(x))


def fp4_qdq_e4m3(x: np.ndarray, block: int = 16) -> np.ndarray:
    """x (..., N) -> nearest E2M1 values under per-`block` E4M3 scales (the compressed KV's grid)."""
    xb = _blocks(x, block)
    amax = np.maximum(np.max(np.abs(xb), axis=-1, keepdims=True), F32(6.0 * 2.0**-9))
    s = np.clip(amax / _FP4_MAX, -_FP8_MAX, _FP8_MAX).astype(_E4M3).astype(F32)
    q = np.clip(xb / s, -_FP4_MAX, _FP4_MAX).astype(_E2M1).astype(F32)
    return (q * s).reshape(np.shape(x))
