"""DeepSeek-V4's shipped activation rounding: E4M3 in groups of 128 with power-of-two scales.

V4's reference inference quantises the input of every FP8 / FP4 linear with `act_quant` (block
128, `scale_fmt="ue8m0"`): per group of 128 values along the last axis, amax = max|x| floored at
1e-4, s = 2^ceil(log2(amax * fl(1/448))), q = E4M3(clip(x / s, -448, 448)) (round to nearest
even), and the linear multiplies q * s. `qdq_v4` returns q * s as float32: the `official`
numerics of V4 feed it to the exact kernels. (V4.1's grid, groups of 32, is `model.v41.quant.fp8_qdq`
and `kernels.qdq`; it is applied by the model, not here.) A last group shorter than 128 (no V4
width has one) is its own group. NaN / infinity propagate as in numpy: a group holding one gives
NaN (or +-448 * s) values.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

GROUP_V4 = 128
E4M3_MAX = np.float32(448.0)
_INV_MAX = np.float32(1.0) / E4M3_MAX
_FLOOR = np.float32(1e-4)


def pow2_ceil(v: np.ndarray) -> np.ndarray:
    """2^ceil(log2(v)) for positive normal float32 v, exactly (exponent, +1 if any mantissa bit)."""
    bits = np.asarray(v, dtype=np.float32).view(np.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)
    return (e.astype(np.int32) << 23).view(np.float32)


def qdq_v4(x: np.ndarray, group: int = GROUP_V4) -> np.ndarray:
    """x (..., C) -> the E4M3 values V4's `act_quant` makes of it, times their scales (float32)."""
    x = np.asarray(x, dtype=np.float32)
    c = x.shape[-1]
    pad = -c % group
    xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x
    xb = xp.reshape(*xp.shape[:-1], -1, group)
    with np.errstate(invalid="ignore"):
        amax = np.maximum(np.max(np.abs(xb), axis=-1, keepdims=True), _FLOOR)
        s = pow2_ceil(amax * _INV_MAX)
        q = np.clip(xb / s, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    out = (q * s).reshape(xp.shape)
    return out[..., :c] if pad else out
