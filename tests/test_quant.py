"""V4.1's activation grids (model/v41/quant.py) against definitions written here in float64.

The reference side enumerates each format's finite values and picks the nearest (ties to the
even code) in float64, and derives the power-of-two scales with math.frexp: it shares nothing
with the module's exponent-bit arithmetic or ml_dtypes' casts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dsv4stream.model.v41.quant import fp4_qdq_e4m3, fp4_qdq_e8m0, fp8_qdq


def _grid(values: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted non-negative magnitudes of a format and whether each one's code is even."""
    mags = np.array(values, dtype=np.float64)
    return mags, np.array([i % 2 == 0 for i in range(len(values))])


def _e4m3_magnitudes() -> list[float]:
    out = [m / 8 * 2.0**-6 for m in range(8)]  # subnormals
    for e in range(1, 16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            out.append((1 + m / 8) * 2.0 ** (e - 7))
    return out


E4M3 = _grid(_e4m3_magnitudes())
E2M1 = _grid([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def nearest(v: np.ndarray, grid: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Round |v| (already clamped into the grid's range) to the nearest grid value, ties to the even code."""
    mags, even = grid
    a = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(mags, a), 0, len(mags) - 1)
    lo = np.clip(hi - 1, 0, len(mags) - 1)
    dlo, dhi = a - mags[lo], mags[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(even[lo], lo, hi)))
    return np.copysign(mags[pick], v)


def pow2_ceil32(amax: np.ndarray, qmax: float) -> np.ndarray:
    """2^ceil(log2(fl32(amax * fl32(1/qmax)))), by frexp in float64."""
    prod = (amax.astype(np.float32) * (np.float32(1) / np.float32(qmax))).astype(np.float64)
    out = []
    for v in prod.ravel():
        m, e = math.frexp(v)  # v = m * 2^e, m in [0.5, 1)
        out.append(2.0 ** (e - 1) if m == 0.5 else 2.0**e)
    return np.array(out).reshape(prod.shape)


def ref_fp8(x: np.ndarray, block: int = 32) -> np.ndarray:
    xb = x.reshape(*x.shape[:-1], -1, block).astype(np.float64)
    amax = np.maximum(np.abs(xb).max(-1, keepdims=True), 1e-4)
    s = pow2_ceil32(amax, 448.0)
    return (nearest(np.clip(xb / s, -448, 448), E4M3) * s).reshape(x.shape)


def ref_fp4_e8m0(x: np.ndarray) -> np.ndarray:
    xb = x.reshape(*x.shape[:-1], -1, 32).astype(np.float64)
    amax = np.maximum(np.abs(xb).max(-1, keepdims=True), 6 * 2.0**-126)
    s = pow2_ceil32(amax, 6.0)
    return (nearest(np.clip(xb / s, -6, 6), E2M1) * s).reshape(x.shape)


def ref_fp4_e4m3(x: np.ndarray) -> np.ndarray:
    xb = x.reshape(*x.shape[:-1], -1, 16).astype(np.float64)
    amax = np.maximum(np.abs(xb).max(-1, keepdims=True), 6 * 2.0**-9)
    s = nearest((amax.astype(np.float32) / np.float32(6)).astype(np.float64), E4M3)
    v = (xb.astype(np.float32) / s.astype(np.float32)).astype(np.float64)  # float32 division, as the kernel
    return (nearest(np.clip(v, -6, 6), E2M1) * s).reshape(x.shape)


def inputs(seed: int) -> np.ndarray:
    """Blocks of 32 at many magnitudes, with exact ties, zeros and values at the scale boundaries."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 128)) * np.exp2(rng.integers(-30, 20, (64, 1)))
    x[0] = 0.0
    x[1, :32] = 448.0 * np.linspace(-1, 1, 32)  # amax exactly 448: scale 1
    x[2, :32] = 449.0 * np.linspace(-1, 1, 32)  # just above: scale 2
    x[3] = np.repeat([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], 16) * np.resize([1, -1], 128)  # E2M1 ties
    x[4, :32] = 1e-6  # below the FP8 amax floor
    return x.astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp8_grid_matches_the_float64_definition(seed):
    x = inputs(seed)
    got = fp8_qdq(x)
    assert got.dtype == np.float32 and np.array_equal(got.astype(np.float64), ref_fp8(x))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp4_grids_match_the_float64_definitions(seed):
    x = inputs(seed)
    assert np.array_equal(fp4_qdq_e8m0(x).astype(np.float64), ref_fp4_e8m0(x))
    assert np.array_equal(fp4_qdq_e4m3(x).astype(np.float64), ref_fp4_e4m3(x))


def test_ties_go_to_the_even_code_and_scales_are_the_next_power_of_two():
    # one block: amax 6 -> E8M0 scale 1 exactly, so the tie values round on the E2M1 grid itself
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4, np.float32)
    assert fp4_qdq_e8m0(ties)[:8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    # FP8: amax 448 -> scale 1, amax 449 -> scale 2 (448 * 2 covers it), 1e-6 -> floor 1e-4
    assert fp8_qdq(np.full(32, 448.0, np.float32))[0] == 448.0
    assert fp8_qdq(np.full(32, 449.0, np.float32))[0] == 448.0  # 449 / 2 = 224.5 -> 224 (even code)
    tiny = fp8_qdq(np.full(32, 1e-6, np.float32))[0]
    assert tiny == np.float32(2.0**-22 * 4)  # scale 2^ceil(log2(1e-4 / 448)) = 2^-22; 1e-6 / 2^-22 ~ 4.19 -> 4


def test_the_power_of_two_grids_are_idempotent_and_every_grid_keeps_shapes():
    x = inputs(5).reshape(4, 16, 128)
    for f in (fp8_qdq, fp4_qdq_e8m0):  # (an E4M3 scale is recomputed from the new amax: not idempotent)
        once = f(x)
        assert once.shape == x.shape and np.array_equal(f(once), once)
    assert fp4_qdq_e4m3(x).shape == x.shape


def test_a_width_that_is_not_a_whole_number_of_blocks_is_refused():
    with pytest.raises(ValueError, match="multiple"):
        fp8_qdq(np.ones((2, 48), np.float32))
