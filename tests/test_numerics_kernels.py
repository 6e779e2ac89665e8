"""The fast-numerics kernels (kernels/q8.py, kernels/bf16.py), their CPU gate (kernels/cpu.py),
V4's activation grid (kernels/actquant.py) and the numerics switch (kernels/numerics.py).

Independent definitions here: int8 quantisation and BF16 rounding in numpy / ml_dtypes, weights
dequantised by `formats` to float64, products in float64. The host variant runs in this process
(AVX-512 on the project machine); the AVX2 variant is forced in-process (the host has AVX2 too)
and compiled for a Haswell target in a subprocess, with the generic target's fallback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numba
import numpy as np
import pytest

from dsv4stream import kernels
from dsv4stream.checkpoint import formats
from dsv4stream.kernels import QWeight, actquant, cpu

q8 = pytest.importorskip("dsv4stream.kernels.q8")
bf16 = pytest.importorskip("dsv4stream.kernels.bf16")

HOST = cpu.variant("fp4")
needs_fast = pytest.mark.skipif(HOST is None, reason="no fast kernel variant for this CPU target")


def activations(rng, t: int, c: int) -> np.ndarray:
    """Heavy-tailed tokens (Student t, 3 dof), per-channel spread, 1/64 outlier channels x10-50."""
    x = rng.standard_t(3, (t, c)).astype(np.float32)
    ch = rng.choice(c, c // 64, replace=False)
    x[:, ch] *= rng.uniform(10, 50, ch.size).astype(np.float32)
    return x * np.exp(rng.normal(0, 1, c)).astype(np.float32)


def weight(rng, kind: str, r: int, c: int, block=(128, 128)) -> QWeight:
    wf = (rng.standard_normal((r, c)) * 0.02).astype(np.float32)
    if kind == "fp4":
        d, s = formats.quantize_fp4(wf)
        return QWeight("fp4", d, s, r, c, role="experts")
    if kind == "fp8":
        d, s = formats.quantize_fp8(wf, block=block)
        return QWeight("fp8", d, s, r, c, block=block)
    return QWeight("bf16", formats.f32_to_bf16(wf), None, r, c, role="head")


def dense64(w: QWeight) -> np.ndarray:
    if w.kind == "fp4":
        return formats.dequant_fp4(w.data, w.scale).astype(np.float64)
    if w.kind == "fp8":
        return formats.dequant_fp8(w.data, w.scale, w.block).astype(np.float64)
    return formats.bf16_to_f32(w.data).astype(np.float64)


def int8_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documented int8 grid: d = fl32(amax / 127), q = rint(x / d) (half to even), |q| <= 127."""
    t, c = x.shape
    xb = x.reshape(t, c // 32, 32)
    d = (np.abs(xb).max(axis=2) / np.float32(127)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(d[..., None] > 0, np.rint(xb / d[..., None]), 0)
    return np.clip(q, -127, 127).astype(np.int8).reshape(t, c), d


def fast_definition(w: QWeight, x: np.ndarray) -> np.ndarray:
    """What `fast` computes, in float64: int8 x for FP4, BF16 x otherwise, exact weights."""
    if w.kind == "fp4":
        q, d = int8_numpy(x)
        xq = q.astype(np.float64) * np.repeat(d, 32, axis=1)
    else:
        xq = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    return xq @ dense64(w).T


@pytest.fixture
def fast_mode():
    kernels.set_numerics("fast")
    yield
    kernels.set_numerics("exact")


# ---------------------------------------------------------------- cpu gate -------------------


def test_cpu_features_follow_numba_target_rules():
    assert cpu.effective("generic", "") == frozenset()
    assert cpu.variant_for("fp4", cpu.effective("generic", "")) is None
    hsw = cpu.effective("haswell", "")
    assert cpu.variant_for("fp4", hsw) == cpu.variant_for("bf16", hsw) == "avx2"
    # explicit entries win over the name's defaults, in both directions
    assert cpu.variant_for("fp4", cpu.effective("haswell", "+avx512f,+avx512bw,+avx512vnni")) == "avx512"
    assert cpu.variant_for("fp4", cpu.effective("sapphirerapids", "-avx512vnni")) == "avx2"
    assert cpu.variant_for("fp8", cpu.effective("cascadelake", "")) == "avx2"  # no BF16 / VBMI
    assert cpu.variant_for("fp8", cpu.effective("znver4", "")) == "avx512"
    # a name the table does not know contributes nothing: never guess an instruction
    assert cpu.variant_for("fp4", cpu.effective("some-future-cpu", "+avx2")) is None


# ---------------------------------------------------------------- activation formats ---------


def test_int8_quantisation_matches_numpy_definition():
    rng = np.random.default_rng(0)
    x = activations(rng, 3, 256)
    x[0, :32] = 0.0  # an all-zero group
    x[1, 40] = x[1, 41] = 1.5 * np.abs(x[1, 32:64]).max()  # ties at the max
    x[2, 64:96] = np.arange(32, dtype=np.float32) * np.float32(127 / 31 / 127)  # halves on the grid
    q, d = q8.quantize_values(x)
    q_ref, d_ref = int8_numpy(x)
    np.testing.assert_array_equal(d, d_ref)
    np.testing.assert_array_equal(q, q_ref)
    assert d[0, 0] == 0 and not q[0, :32].any()


def test_int8_nonfinite_group_gives_nan_outputs():
    x = np.ones((1, 256), np.float32)
    x[0, 5] = np.nan
    _, d = q8.quantize_values(x)
    assert np.isnan(d[0, 0]) and np.isfinite(d[0, 1:]).all()


def test_bf16_rounding_is_nearest_even_like_ml_dtypes():
    rng = np.random.default_rng(1)
    bits = np.concatenate(
        [rng.integers(0, 2**32, 4000, dtype=np.uint64), [0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFF800000, 0x00000001]]
    )
    x = bits.astype(np.uint32).view(np.float32)
    x = x[np.isfinite(x) | np.isinf(x)].reshape(1, -1)
    np.testing.assert_array_equal(bf16.to_bf16(x), x.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.isnan(bf16.to_bf16(np.array([[np.nan]], np.float32)).view(ml_dtypes.bfloat16).astype(np.float32)).all()


def test_qdq_v4_is_the_model_grid_at_128():
    from dsv4stream.model.v41.quant import fp8_qdq

    x = activations(np.random.default_rng(2), 4, 512)
    np.testing.assert_array_equal(actquant.qdq_v4(x), fp8_qdq(x, 128))
    y = actquant.qdq_v4(x)
    g = np.abs(x.reshape(4, 4, 128)).max(axis=2)
    s = actquant.pow2_ceil(np.maximum(g, 1e-4) / np.float32(448))
    assert np.all(np.abs(y.reshape(4, 4, 128)) <= 448 * s[..., None])


# ---------------------------------------------------------------- products -------------------

CASES = [("fp4", (128, 128)), ("fp8", (128, 128)), ("fp8", (32, 32)), ("bf16", (128, 128))]


@needs_fast
@pytest.mark.parametrize("variant", ["host", "avx2"])
@pytest.mark.parametrize("kind,block", CASES, ids=["fp4", "fp8-128", "fp8-32", "bf16"])
def test_fast_products_match_float64_definition(kind, block, variant):
    rng = np.random.default_rng(3)
    w = weight(rng, kind, 160, 512, block)  # 160 rows: a partial row block and work item
    x = activations(rng, 7, 512)
    v = cpu.variant(kind) if variant == "host" else "avx2"
    if kind == "fp4":
        y = q8.matmul(w.data, w.scale, x, v)
    elif kind == "fp8":
        y = bf16.fp8_matmul(w.data, w.scale, w.block, x, v)
    else:
        y = bf16.bf16_matmul(w.data, x, v)
    ref = fast_definition(w, x)
    bound = np.abs(x).astype(np.float64) @ np.abs(dense64(w)).T  # float32 summation error scale
    assert np.all(np.abs(y - ref) <= 1e-6 * bound + 1e-30)


@needs_fast
@pytest.mark.parametrize("kind,block", CASES, ids=["fp4", "fp8-128", "fp8-32", "bf16"])
def test_fast_rows_do_not_depend_on_tokens_or_threads(kind, block, fast_mode):
    rng = np.random.default_rng(4)
    w = weight(rng, kind, 96, 512, block)
    x = activations(rng, 5, 512)
    y5 = kernels.matmul(w, x)
    for t in range(5):
        np.testing.assert_array_equal(kernels.matvec(w, x[t]), y5[t])
    np.testing.assert_array_equal(kernels.matmul(w, x[1:3]), y5[1:3])
    other = x.copy()
    other[[0, 2, 3, 4]] = activations(rng, 4, 512)
    np.testing.assert_array_equal(kernels.matmul(w, other)[1], y5[1])
    if numba.config.NUMBA_NUM_THREADS >= 2:
        before = kernels.get_threads()
        try:
            kernels.set_threads(1)
            one = kernels.matmul(w, x)
            kernels.set_threads(2)
            np.testing.assert_array_equal(kernels.matmul(w, x), one)
        finally:
            kernels.set_threads(before)
        np.testing.assert_array_equal(one, y5)


@needs_fast
def test_fast_pair_and_grouped_equal_single_products(fast_mode):
    rng = np.random.default_rng(5)
    w1, w3 = weight(rng, "fp4", 64, 512), weight(rng, "fp4", 64, 512)
    x = activations(rng, 3, 512)
    a, b = kernels.matmul_pair(w1, w3, x)
    np.testing.assert_array_equal(a, kernels.matmul(w1, x))
    np.testing.assert_array_equal(b, kernels.matmul(w3, x))
    ws = [weight(rng, "fp8", 64, 256), weight(rng, "fp8", 64, 256)]
    xg = np.stack([activations(rng, 2, 256), activations(rng, 2, 256)], axis=1)
    got = kernels.matmul_grouped(ws, xg)
    np.testing.assert_array_equal(got, np.concatenate([kernels.matmul(w, xg[:, i]) for i, w in enumerate(ws)], axis=1))


@needs_fast
@pytest.mark.parametrize("kind,block", CASES[:3], ids=["fp4", "fp8-128", "fp8-32"])
def test_fast_is_at_least_as_close_to_float32_as_official(kind, block):
    """The project rule: on realistic activations and release-format weights, fast's error
    against the float32 product (max and median over outputs, relative to the output RMS)
    is no larger than DeepSeek's official V4 rounding (E4M3 / 128, UE8M0) gives."""
    rng = np.random.default_rng(6)
    w = weight(rng, kind, 256, 2048, block)
    x = activations(rng, 8, 2048)
    ref = x.astype(np.float64) @ dense64(w).T
    rms = np.sqrt((ref**2).mean(axis=1, keepdims=True))
    errs = {}
    try:
        for mode in ("official", "fast"):
            kernels.set_numerics(mode)
            e = np.abs(kernels.matmul(w, x) - ref) / rms
            errs[mode] = (e.max(), np.median(e))
    finally:
        kernels.set_numerics("exact")
    assert errs["fast"][0] <= errs["official"][0] and errs["fast"][1] <= errs["official"][1], errs


def test_exact_mode_is_the_backend_bit_for_bit():
    rng = np.random.default_rng(7)
    w = weight(rng, "fp4", 64, 512)
    x = activations(rng, 3, 512)
    kernels.set_numerics("exact")
    assert kernels._numerics is None and kernels.get_numerics() == "exact"
    np.testing.assert_array_equal(kernels.matmul(w, x), kernels._active().matmul(w, x))


def test_official_mode_feeds_the_v4_grid_to_the_exact_kernels():
    rng = np.random.default_rng(8)
    w8, wb = weight(rng, "fp8", 64, 512), weight(rng, "bf16", 64, 512)
    x = activations(rng, 2, 512)
    try:
        kernels.set_numerics("official")
        np.testing.assert_array_equal(kernels.matmul(w8, x), kernels._active().matmul(w8, actquant.qdq_v4(x)))
        np.testing.assert_array_equal(kernels.matvec(w8, x[0]), kernels._active().matvec(w8, actquant.qdq_v4(x[0])))
        np.testing.assert_array_equal(kernels.matmul(wb, x), kernels._active().matmul(wb, x))  # BF16: float32
    finally:
        kernels.set_numerics("exact")


def test_fast_leaves_what_it_cannot_take_to_the_exact_kernels(fast_mode):
    rng = np.random.default_rng(11)
    x = activations(rng, 2, 256)
    narrow = weight(rng, "fp4", 32, 224)  # 224 % 256 != 0
    wide = weight(rng, "bf16", 32, 512)
    strided = QWeight("bf16", wide.data[:, :256], None, 32, 256, role="head")  # rows not contiguous
    f32 = QWeight("f32", rng.standard_normal((32, 256)).astype(np.float32), None, 32, 256)
    for w, xx in ((narrow, activations(rng, 2, 224)), (strided, x), (f32, x)):
        assert kernels.fast_variant(w) is None
        np.testing.assert_array_equal(kernels.matmul(w, xx), kernels._active().matmul(w, xx))


def test_unknown_numerics_is_refused():
    with pytest.raises(ValueError, match="exact, official, fast"):
        kernels.set_numerics("int4")


# ---------------------------------------------------------------- other CPU targets ----------

_CHILD = textwrap.dedent(
    """
    import numpy as np
    from dsv4stream import kernels
    from dsv4stream.checkpoint import formats
    from dsv4stream.kernels import QWeight, cpu
    rng = np.random.default_rng(9)
    d, s = formats.quantize_fp4((rng.standard_normal((48, 256)) * 0.02).astype(np.float32))
    w = QWeight("fp4", d, s, 48, 256)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    kernels.set_numerics("exact")
    exact = kernels.matmul(w, x)
    kernels.set_numerics("fast")
    y = kernels.matmul(w, x)
    print(cpu.variant("fp4"), bool(np.array_equal(y, exact)), float(np.abs(y - exact).max() / np.abs(exact).max()))
    print(bool(np.array_equal(kernels.matvec(w, x[1]), y[1])))
    """
)


@pytest.mark.parametrize("target,variant", [("haswell", "avx2"), ("ivybridge", "None")])
def test_other_targets_choose_their_variant_and_run(target, variant):
    env = dict(
        os.environ, NUMBA_CPU_NAME=target, NUMBA_CPU_FEATURES="", NUMBA_CACHE_DIR=os.environ.get("NUMBA_CACHE_DIR", "")
    )
    if not env["NUMBA_CACHE_DIR"]:
        env.pop("NUMBA_CACHE_DIR")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], check=False, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = out.stdout.split("\n")[:2]
    got_variant, same, err = first.split()
    assert got_variant == variant
    assert same == ("True" if variant == "None" else "False")  # the fallback is the exact kernels
    assert float(err) < 0.05 and second == "True"


@needs_fast
def test_fp4_scale_forms_and_e8m0_edges():
    """float32 scales (any value) and E8M0 edge bytes: 0 is 2^-127, 0xFF is NaN (its row)."""
    rng = np.random.default_rng(10)
    wf = (rng.standard_normal((32, 256)) * 0.02).astype(np.float32)
    d, s32 = formats.quantize_fp4(wf, scale_fmt="float32")
    x = activations(rng, 2, 256)
    w = QWeight("fp4", d, s32, 32, 256)
    y = q8.matmul(w.data, w.scale, x)
    assert np.all(np.abs(y - fast_definition(w, x)) <= 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(dense64(w)).T))
    d8, s8 = formats.quantize_fp4(wf)
    s8[0, 3], s8[1, :] = 255, 0
    y = q8.matmul(d8, s8, x)
    assert np.isnan(y[:, 0]).all() and np.isfinite(y[:, 1:]).all()
    w1 = QWeight("fp4", d8[1:2], s8[1:2], 1, 256)
    np.testing.assert_allclose(y[:, 1], fast_definition(w1, x)[:, 0], rtol=1e-5)


@needs_fast
@pytest.mark.parametrize("variant", ["host", "avx2"])
def test_fp4_e8m0_bytes_read_in_the_loop_equal_their_float32_values(variant):
    """The kernel turns E8M0 bytes 1..254 into float32 by a shift (2^(b-127) = b << 23), and 0
    and 0xFF by the same shift with bit 22 set (2^-127 and NaN). Both equal the same scales given
    as float32, at widths with and without AVX-512's two-step tail (256, 512, 768)."""
    v = cpu.variant("fp4") if variant == "host" else "avx2"
    rng = np.random.default_rng(11)
    for cols in (256, 512, 768):
        rows = 254 * 32 // cols + 40  # every byte 1..254 once, then random ones; several row blocks
        s = np.concatenate([np.arange(1, 255), rng.integers(100, 140, rows * cols // 32 - 254)]).astype(np.uint8)
        s = s.reshape(rows, cols // 32)
        d = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        x = activations(rng, 5, cols) * np.float32(1e-3)
        y = q8.matmul(d, s, x, v)
        np.testing.assert_array_equal(y, q8.matmul(d, formats.e8m0_to_f32(s), x, v))
        edged = s.copy()
        edged[-3, 0], edged[-20, -1] = 0, 255  # the two bytes the shift alone gets wrong
        y = q8.matmul(d, edged, x, v)
        want = q8.matmul(d, formats.e8m0_to_f32(edged), x, v)
        np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
        np.testing.assert_array_equal(y[~np.isnan(y)], want[~np.isnan(want)])
        assert np.isnan(y[:, -20]).all() and np.isfinite(y[:, -19:]).all() and np.isfinite(y[:, -40:-20]).all()


def test_fp4_activation_scratch_starts_on_cache_lines():
    for t, c in ((1, 256), (3, 4096), (7, 2304)):
        for a in q8.scratch(t, c):
            assert a.ctypes.data % 64 == 0 and a.flags.c_contiguous
