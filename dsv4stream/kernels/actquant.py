"""DeepSeek-V4's shipped rounding: E4M3 in groups of 128 with power-of-two scales before the
linears, and the KV grids of its attention (window and compressed KV, the indexer: below).

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
_FLOOR = np.float32(1e-4)


def pow2_ceil(v: np.ndarray) -> np.ndarray:
    """2^ceil(log2(v)) for positive normal float32 v, exactly (exponent, +1 if any mantissa bit)."""
    bits = np.asarray(v, dtype=np.float32).view(np.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)
    return (e.astype(np.int32) << 23).view(np.float32)


def _grid_qdq(x: np.ndarray, group: int, top: np.float32, floor: np.float32, dtype) -> np.ndarray:
    """x (..., C) -> its values on the grid of `dtype` (largest magnitude `top`) times a
    power-of-two scale per group of `group` channels: amax floored at `floor`,
    s = 2^ceil(log2(amax * fl(1/top))), round to nearest even. A short last group (generated
    checkpoints' narrower widths) is its own group."""
    x = np.asarray(x, dtype=np.float32)
    c = x.shape[-1]
    pad = -c % group
    xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x
    xb = xp.reshape(*xp.shape[:-1], -1, group)
    with np.errstate(invalid="ignore"):
        amax = np.maximum(np.max(np.abs(xb), axis=-1, keepdims=True), floor)
        s = pow2_ceil(amax * (np.float32(1.0) / top))
        q = np.clip(xb / s, -top, top).astype(dtype).astype(np.float32)
    out = (q * s).reshape(xp.shape)
    return out[..., :c] if pad else out


def qdq_v4(x: np.ndarray, group: int = GROUP_V4) -> np.ndarray:
    """x (..., C) -> the E4M3 values V4's `act_quant` makes of it, times their scales (float32)."""
    return _grid_qdq(x, group, E4M3_MAX, _FLOOR, ml_dtypes.float8_e4m3fn)


# ---- V4's KV grids (`official` only) -----------------------------------------------------------
#
# DeepSeek's V4 `inference/model.py` also rounds what attention keeps, in place, before it is
# used or cached: the window KV and the main compressor's rows after their norm and RoPE,
# `act_quant(kv[..., :-rd], 64, "ue8m0")` (the RoPE channels stay as they are); the indexer's
# compressed keys and its queries after RoPE, `rotate_activation` (a Hadamard transform times
# d^-0.5) then `fp4_act_quant(., 32)` (E2M1, power-of-two scales). q . k is unchanged by the
# rotation itself (it is orthogonal); it matters through the FP4 grid it precedes.

KV_GROUP_V4 = 64
FP4_GROUP_V4 = 32
E2M1_MAX = np.float32(6.0)
_FP4_FLOOR = np.float32(6.0 * 2.0**-126)


def kv_grid_v4(kv: np.ndarray, rope_dims: int) -> np.ndarray:
    """kv (..., hd) with its first hd - rope_dims channels on V4's E4M3 grid in groups of 64."""
    out = np.array(kv, dtype=np.float32)
    nope = out.shape[-1] - rope_dims
    out[..., :nope] = qdq_v4(out[..., :nope], KV_GROUP_V4)
    return out


def hadamard(x: np.ndarray) -> np.ndarray:
    """x (..., n) times the Sylvester Hadamard matrix of order n (a power of two) and n^-0.5,
    along the last axis (what `fast_hadamard_transform` computes); butterflies in float64."""
    n = x.shape[-1]
    if n & (n - 1) or n == 0:
        raise ValueError(f"a Hadamard rotation needs a power-of-two width, found {n}")
    y = np.array(x, dtype=np.float64).reshape(-1, n)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        y = np.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], axis=2)
        h *= 2
    return (y.reshape(np.shape(x)) * n**-0.5).astype(np.float32)


def fp4_qdq_v4(x: np.ndarray, group: int = FP4_GROUP_V4) -> np.ndarray:
    """x (..., C) -> E2M1 values times power-of-two scales per group:
    amax floored at 6 * 2^-126, s = 2^ceil(log2(amax * fl(1/6))), round to nearest even."""
    return _grid_qdq(x, group, E2M1_MAX, _FP4_FLOOR, ml_dtypes.float4_e2m1fn)


def index_grid_v4(x: np.ndarray) -> np.ndarray:
    """The indexer's queries or keys (..., index_head_dim) as V4 scores them: rotated, then FP4."""
    return fp4_qdq_v4(hadamard(x))
