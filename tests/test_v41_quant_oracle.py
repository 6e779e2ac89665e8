"""V4.1 activation quantisation against DeepSeek's kernels, bit for bit (tests/fixtures/v41/quant,
written by `tools/make_v41_fixtures.py --quant` from the torch ports of DeepSeek's tilelang kernels).

The inputs are bf16 values chosen to reach every rounding case: blocks of every magnitude from
1e-30 to the bf16 maximum, all-zero blocks and blocks below the amax floors, signed zeros,
values on E2M1 and E4M3 round-to-nearest-even ties, +-448 and beyond. The reference returns bf16;
its values are exactly representable, so ours must equal them as float32.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dsv4stream.model.v41.quant import fp4_qdq_e4m3, fp4_qdq_e8m0, fp8_qdq

FIX = Path(__file__).parent / "fixtures" / "v41" / "quant" / "qdq.npz"
Z = np.load(FIX)
CASES = {"fp8_qdq": fp8_qdq, "fp4_e8m0_qdq": fp4_qdq_e8m0, "fp4_e4m3_qdq": fp4_qdq_e4m3}


def same_bits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.astype(np.float32).view(np.uint32) == b.astype(np.float32).view(np.uint32)


@pytest.mark.parametrize("key", CASES)
def test_qdq_equals_the_reference_kernels_bit_for_bit(key: str) -> None:
    with np.errstate(over="ignore"):  # the bf16 maximum rounds up past the float32 range, as in the kernels
        got = CASES[key](Z["x"])
    bad = np.argwhere(~same_bits(got, Z[key]))
    assert bad.size == 0, f"{key}: {len(bad)} values differ, first at {bad[0].tolist()}"


def test_fp8_codes_and_scales_are_the_ones_behind_the_values() -> None:
    q = Z["fp8_codes"].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = np.repeat(Z["fp8_scales"], 32, axis=-1)
    with np.errstate(over="ignore"):
        assert same_bits(q * s, Z["fp8_qdq"]).all()
    assert (np.unique(Z["fp8_scales"]) == np.exp2(np.log2(np.unique(Z["fp8_scales"])).round())).all()  # powers of two


def test_a_wrong_rounding_rule_is_caught() -> None:
    # ties away from zero instead of to even, and a floor instead of a ceil for the scale
    x = Z["x"].reshape(Z["x"].shape[0], -1, 32)
    amax = np.maximum(np.abs(x).max(-1, keepdims=True), np.float32(1e-4))
    s = np.exp2(np.floor(np.log2(amax / np.float32(448)))).astype(np.float32)
    q = np.clip(x / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        wrong = (q * s).reshape(Z["x"].shape)
    assert not same_bits(wrong, Z["fp8_qdq"]).all()
