"""DeepSeek-V4.1's activation grid in one numba pass: the fast form of `model.v41.quant.fp8_qdq`.

Owns `fp8_qdq_rows`: X (N, C) float32, C a multiple of 32 -> the nearest E4M3 values under one
power-of-two scale per 32 values along C, bit for bit what `model.v41.quant.fp8_qdq(x, 32)` (numpy
and ml_dtypes, the definition checked against DeepSeek's kernels) returns. Every FP8 / FP4
linear of V4.1 meets its input through this grid: about 12 calls per layer and token, each a
dozen numpy passes over a few KB, which cost more than the arithmetic (see docs/performance.md).

Arithmetic, step by step as the numpy definition does it (all float32, IEEE, no fastmath):
- amax = max |x| over the block, floored at fl(1e-4); s = 2^ceil(log2(amax * fl(1/448))) from the
  exponent bits (+1 when any mantissa bit is set);
- v = x / s (a division, as numpy's), clipped to +-448;
- E4M3 round to nearest even: below 2^-6 the grid is the subnormal step 2^-9, so
  rint(v * 2^9) * 2^-9 (both products exact); from 2^-6 up, the float32 mantissa is rounded to
  3 bits with the integer carry trick (ties to even; a carry into the exponent is the right
  result); then q * s.
A block holding a NaN or an infinity is not handled here: the caller falls back to the numpy
definition for the whole array (the result there is NaN / inf / 448 * s depending on where the
non-finite value sits, which is not worth a second copy of).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .jit import _JIT

BLOCK = 32
_FLOOR = np.float32(1e-4)
_INV_MAX = np.float32(1.0) / np.float32(448.0)
_MAX = np.float32(448.0)
_SUB = np.float32(512.0)  # 2^9: E4M3's subnormal step is 2^-9
_INV_SUB = np.float32(1.0 / 512.0)
_MIN_NORMAL = np.float32(2.0**-6)


@njit(**_JIT)
def _qdq_rows(x, out):
    """x, out (N, C) float32, C % 32 == 0. Returns False (out unspecified) on a non-finite input."""
    n, c = x.shape
    bits = np.empty(BLOCK, np.float32)
    for r in range(n):
        for b in range(c // BLOCK):
            j0 = b * BLOCK
            amax = np.float32(0.0)
            finite = True
            for k in range(BLOCK):
                a = abs(x[r, j0 + k])
                if not a <= np.float32(3.4028234663852886e38):
                    finite = False
                amax = max(amax, a)
            if not finite:
                return False
            amax = max(amax, _FLOOR)
            t = np.float32(amax * _INV_MAX)
            tb = np.int64(np.float32(t).view(np.int32))
            e = ((tb >> 23) & 0xFF) + ((tb & 0x7FFFFF) != 0)
            s = np.int32(e << 23).view(np.float32)
            for k in range(BLOCK):
                v = np.float32(x[r, j0 + k] / s)
                v = min(max(v, -_MAX), _MAX)
                av = abs(v)
                sub = np.float32(np.rint(np.float32(av * _SUB)) * _INV_SUB)
                vb = np.int64(np.float32(av).view(np.int32))
                vb = (vb + 0x7FFFF + ((vb >> 20) & 1)) & 0x7FF00000
                q = sub if av < _MIN_NORMAL else np.int32(vb).view(np.float32)
                bits[k] = np.float32(np.float32(math.copysign(q, v)) * s)
            for k in range(BLOCK):
                out[r, j0 + k] = bits[k]
    return True


def fp8_qdq_rows(x: np.ndarray) -> np.ndarray | None:
    """X (..., C) float32, C % 32 == 0 -> the grid values (same shape), or None where a value is
    NaN or infinite (the caller then uses the numpy definition)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[-1] % BLOCK:
        raise ValueError(f"QDQ in blocks of {BLOCK} needs a last axis that is a multiple of it, found {x.shape}")
    flat = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
    if not flat.flags.writeable:
        flat = flat.copy()  # numba types read-only arrays apart: one signature only
    out = np.empty(flat.shape, np.float32)
    if not _qdq_rows(flat, out):
        return None
    return out.reshape(x.shape)


def warmup() -> None:
    fp8_qdq_rows(np.ones((1, BLOCK), np.float32))
