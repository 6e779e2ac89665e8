"""Number formats against values computed here from the bit definitions (never via ml_dtypes).

E4M3FN: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinity; S.1111.111 is NaN; max 448.
E8M0: unsigned exponent only, value 2^(b - 127); 0xFF is NaN.
E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from dsv4stream.checkpoint import formats


def e4m3_ref(b: int) -> float:
    s, e, m = b >> 7, (b >> 3) & 0xF, b & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    mag = (m / 8) * 2.0 ** (1 - 7) if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


def e8m0_ref(b: int) -> float:
    b = int(b)
    return math.nan if b == 0xFF else math.ldexp(1.0, b - 127)


def e2m1_ref(c: int) -> float:
    s, e, m = c >> 3, (c >> 1) & 0x3, c & 0x1
    mag = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -mag if s else mag


E4M3_TABLE = np.array([e4m3_ref(b) for b in range(256)], dtype=np.float64)
E2M1_TABLE = np.array([e2m1_ref(c) for c in range(16)], dtype=np.float64)


def same_values(got: np.ndarray, want: np.ndarray) -> None:
    """Equal values, NaN where NaN is expected, and equal sign bits (so -0.0 != +0.0)."""
    with np.errstate(invalid="ignore"):  # signalling NaN patterns warn when widened
        got = np.asarray(got, dtype=np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok], want[ok])
    assert np.array_equal(np.signbit(got[ok]), np.signbit(want[ok]))


# ---- codecs: every code --------------------------------------------------------------


def test_e4m3_all_256_codes():
    got = formats.e4m3_to_f32(np.arange(256, dtype=np.uint8))
    assert got.dtype == np.float32
    same_values(got, E4M3_TABLE)


def test_e4m3_landmarks():
    v = formats.e4m3_to_f32(np.array([0x38, 0xB8, 0x7E, 0xFE, 0x01, 0x07, 0x08, 0x80, 0x7F, 0xFF], np.uint8))
    assert v[0] == 1.0 and v[1] == -1.0
    assert v[2] == 448.0 and v[3] == -448.0  # max finite: no infinity in the FN variant
    assert v[4] == 2.0**-9  # smallest subnormal
    assert v[5] == 7 * 2.0**-9  # largest subnormal
    assert v[6] == 2.0**-6  # smallest normal
    assert v[7] == 0.0 and np.signbit(v[7])
    assert np.isnan(v[8]) and np.isnan(v[9])
    assert np.nanmax(np.abs(E4M3_TABLE)) == 448.0
    assert np.isnan(E4M3_TABLE).sum() == 2


def test_e8m0_all_256_codes():
    got = formats.e8m0_to_f32(np.arange(256, dtype=np.uint8))
    want = np.array([e8m0_ref(b) for b in range(256)])
    same_values(got, want)
    assert got[127] == 1.0
    assert got[0] == 2.0**-127 and got[0] > 0  # b = 0 is not zero
    assert got[254] == 2.0**127
    assert np.isnan(got[255])


def test_e2m1_all_16_codes():
    got = formats.e2m1_to_f32(np.arange(16, dtype=np.uint8))
    same_values(got, E2M1_TABLE)
    assert list(E2M1_TABLE[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert list(E2M1_TABLE[8:]) == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def test_bf16_all_codes_and_rounding():
    bits = np.arange(1 << 16, dtype=np.uint32)
    want = (bits << 16).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
        same_values(formats.bf16_to_f32(bits.astype(np.uint16)), want.astype(np.float64))
    for b, v in ((0x3F80, 1.0), (0xC000, -2.0), (0x7F80, math.inf), (0x0001, 2.0**-133)):
        assert struct.unpack("<f", struct.pack("<I", b << 16))[0] == v
        assert formats.bf16_to_f32(np.array([b], np.uint16))[0] == v
    # 7 mantissa bits: ulp(1) = 2^-7. Halfway cases round to the even neighbour.
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -3.0], np.float32)
    got = formats.f32_to_bf16(x)
    assert got.dtype == np.uint16
    assert list(got) == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC040]


def test_scale_to_f32_accepts_both_storages():
    assert list(formats.scale_to_f32(np.array([126, 127, 130], np.uint8))) == [0.5, 1.0, 8.0]
    f = np.array([0.3, 7.0], np.float32)
    assert np.array_equal(formats.scale_to_f32(f), f)


# ---- FP4 packing ----------------------------------------------------------------------


def test_fp4_nibble_order_even_element_low():
    packed = formats.pack_fp4(np.array([[1, 2, 7, 0xF]], np.uint8))
    assert packed.dtype == np.uint8
    assert list(packed[0]) == [0x21, 0xF7]
    assert list(formats.unpack_fp4(np.array([[0x21, 0xF7]], np.uint8))[0]) == [0.5, 1.0, 6.0, -6.0]
    # int8 storage (as on disk) unpacks the same way
    assert list(formats.unpack_fp4(np.array([[0x21, 0xF7]], np.uint8).view(np.int8))[0]) == [0.5, 1.0, 6.0, -6.0]
    with pytest.raises(ValueError):
        formats.pack_fp4(np.zeros((1, 3), np.uint8))


def test_fp4_pack_unpack_every_pair():
    lo, hi = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    codes = np.stack([lo.ravel(), hi.ravel()], axis=1).astype(np.uint8)  # (256, 2)
    packed = formats.pack_fp4(codes)
    assert list(packed[:, 0]) == [int(a) | int(b) << 4 for a, b in codes]
    same_values(formats.unpack_fp4(packed), E2M1_TABLE[codes])


# ---- block dequantisation -----------------------------------------------------------------


def _fp8_expected(w: np.ndarray, scale_vals: np.ndarray) -> np.ndarray:
    r, c = w.shape
    out = np.empty((r, c))
    for i in range(r):
        for j0 in range(0, c, 128):
            out[i, j0 : j0 + 128] = E4M3_TABLE[w[i, j0 : j0 + 128]] * scale_vals[i // 128, j0 // 128]
    return out


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"])
def test_dequant_fp8_ceil_edges(scale_fmt):
    rng = np.random.default_rng(1)
    r, c = 130, 200  # neither a multiple of 128: scales are (2, 2) with partial edge blocks
    w = rng.integers(0, 256, size=(r, c), dtype=np.uint8)
    w[w & 0x7F == 0x7F] = 0x10  # keep NaN codes out
    if scale_fmt == "ue8m0":
        s = np.array([[120, 127], [130, 140]], np.uint8)
        sv = np.array([[e8m0_ref(b) for b in row] for row in s])
    else:
        s = np.array([[0.25, 3.0], [1e-3, 17.5]], np.float32)
        sv = s.astype(np.float64)
    assert formats.fp8_scale_shape(r, c) == (2, 2)
    got = formats.dequant_fp8(w, s)
    assert got.shape == (r, c) and got.dtype == np.float32
    np.testing.assert_allclose(got, _fp8_expected(w, sv), rtol=1e-7, atol=0)
    assert got[129, 199] == np.float32(E4M3_TABLE[w[129, 199]] * sv[1, 1])  # edge block uses the last scale
    with pytest.raises(ValueError):
        formats.dequant_fp8(w, np.zeros((1, 2), np.uint8))


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"])
def test_dequant_fp4_1x32(scale_fmt):
    rng = np.random.default_rng(2)
    r, c = 3, 96
    packed = rng.integers(0, 256, size=(r, c // 2), dtype=np.uint8)
    if scale_fmt == "ue8m0":
        s = rng.integers(100, 150, size=(r, c // 32), dtype=np.uint8)
        sv = np.vectorize(e8m0_ref)(s)
    else:
        s = rng.uniform(0.01, 2, size=(r, c // 32)).astype(np.float32)
        sv = s.astype(np.float64)
    want = np.empty((r, c))
    for i in range(r):
        for j in range(c):
            byte = int(packed[i, j // 2])
            code = byte & 0xF if j % 2 == 0 else byte >> 4
            want[i, j] = E2M1_TABLE[code] * sv[i, j // 32]
    got = formats.dequant_fp4(packed, s)
    assert got.shape == (r, c)
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=0)
    with pytest.raises(ValueError):
        formats.dequant_fp4(packed, s[:, :2])


# ---- quantisers: round trips land on the nearest representable value ----------------------


def _nearest_error(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """|x - nearest point of the sorted grid|."""
    i = np.clip(np.searchsorted(grid, x), 1, len(grid) - 1)
    return np.minimum(np.abs(x - grid[i - 1]), np.abs(x - grid[i]))


FP8_GRID = np.unique(E4M3_TABLE[~np.isnan(E4M3_TABLE)])
FP4_GRID = np.unique(E2M1_TABLE)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"])
def test_quantize_fp8_round_trip(scale_fmt):
    rng = np.random.default_rng(3)
    r, c = 130, 260
    w = (rng.standard_normal((r, c)) * np.exp(rng.uniform(-6, 6, size=(r, 1)))).astype(np.float32)
    w[:128, :128] = 0.0  # an all-zero block
    q, s = formats.quantize_fp8(w, scale_fmt)
    assert q.dtype == np.uint8 and q.shape == (r, c)
    assert s.shape == (2, 3) and s.dtype == (np.uint8 if scale_fmt == "ue8m0" else np.float32)
    sv = np.array([[e8m0_ref(b) for b in row] for row in s]) if scale_fmt == "ue8m0" else s.astype(np.float64)
    assert sv[0, 0] == 1.0  # zero block gets scale 1
    full = np.repeat(np.repeat(sv, 128, 0), 128, 1)[:r, :c]
    x = w / full
    assert np.abs(x).max() <= 448.0 * (1 + 1e-6)  # float scales: amax / 448 rounded to float32
    deq = formats.dequant_fp8(q, s)
    # Each element is the nearest E4M3 value times its block scale (ties have measure zero).
    err = np.abs(deq.astype(np.float64) / full - x)
    # slack: the quantiser divides and the dequantiser multiplies in float32
    assert np.all(err <= _nearest_error(x, FP8_GRID) * (1 + 1e-5) + np.abs(x) * 1e-6)
    bmax = np.abs(np.pad(x, ((0, 126), (0, 124)))).reshape(2, 128, 3, 128).max(axis=(1, 3)).ravel()[1:]
    if scale_fmt == "ue8m0":
        assert np.all((bmax > 224) & (bmax <= 448))  # the smallest power of two that fits
    else:
        np.testing.assert_allclose(bmax, 448.0, rtol=1e-6)  # amax / 448: the block max maps to 448


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"])
def test_quantize_fp4_round_trip(scale_fmt):
    rng = np.random.default_rng(4)
    r, c = 5, 128
    w = (rng.standard_normal((r, c)) * np.exp(rng.uniform(-4, 4, size=(r, 1)))).astype(np.float32)
    w[0, :32] = 0.0
    packed, s = formats.quantize_fp4(w, scale_fmt)
    assert packed.shape == (r, c // 2) and s.shape == (r, c // 32)
    sv = np.vectorize(e8m0_ref)(s) if scale_fmt == "ue8m0" else s.astype(np.float64)
    assert sv[0, 0] == 1.0
    full = np.repeat(sv, 32, axis=1)
    x = w / full
    assert np.abs(x).max() <= 6.0 * (1 + 1e-6)
    deq = formats.dequant_fp4(packed, s)
    err = np.abs(deq.astype(np.float64) / full - x)
    assert np.all(err <= _nearest_error(x, FP4_GRID) * (1 + 1e-5) + np.abs(x) * 1e-6)
    if scale_fmt == "ue8m0":
        bmax = np.abs(x).reshape(r, -1, 32).max(axis=2)[1:]
        assert np.all((bmax > 3) & (bmax <= 6))
    with pytest.raises(ValueError):
        formats.quantize_fp4(np.zeros((2, 40), np.float32))


def test_quantize_fp8_saturates_instead_of_nan():
    # a value above 448 * scale cannot occur with amax scaling; but rounding must never give NaN
    w = np.full((4, 4), 1e-30, np.float32)
    w[0, 0] = 1.0
    q, s = formats.quantize_fp8(w, "ue8m0")
    assert not np.isnan(formats.dequant_fp8(q, s)).any()
