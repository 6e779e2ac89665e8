"""The FP8 trunk as int8 (`kernels/trunkq8.py`, fast numerics where the FP8 fast variant is
"avx2"): the conversion and the products against float64 numpy of the same roundings (ml_dtypes
decodes E4M3; nothing of ours on that side), bits independent of threads, tokens and the pair /
grouped forms, NaN scales and codes, the engine's switch (`DSV4_INT8_TRUNK=1`) and that exact
refuses an int8 weight; the fast model within official's bound on two oracle fixtures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numba
import numpy as np
import pytest

from dsv4stream import kernels
from dsv4stream.checkpoint.formats import QWeight
from dsv4stream.kernels import trunkq8

pytestmark = [
    pytest.mark.skipif(kernels.backend_name() != "fast", reason="numba kernels only"),
    pytest.mark.skipif(not trunkq8.possible(), reason="no int8 trunk on this CPU target"),
]
ROOT = Path(__file__).resolve().parents[1]


def _fp8(seed: int, rows: int, cols: int, block: tuple[int, int], f32_scales: bool = False) -> QWeight:
    """Random E4M3 bytes (no NaN codes), block scales of several magnitudes."""
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((rows, cols)) * rng.uniform(1, 150, (rows, 1))
    data = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    shape = (-(-rows // block[0]), -(-cols // block[1]))
    scale = rng.integers(110, 125, shape).astype(np.uint8)
    if f32_scales:
        scale = (np.exp2(scale.astype(np.float64) - 127) * rng.uniform(0.6, 1.4, shape)).astype(np.float32)
    return QWeight("fp8", np.ascontiguousarray(data), scale, rows, cols, block=block)


def _scales64(w: QWeight) -> np.ndarray:
    s = w.scale.astype(np.float64) if w.scale.dtype == np.float32 else np.exp2(w.scale.astype(np.float64) - 127)
    return s


def _reference(w: QWeight, x: np.ndarray):
    """(int8 weights, block factors, float64 product) by the module doc's roundings."""
    br, bc = w.block
    v = w.data.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    q = np.empty(v.shape, np.int8)
    k = np.empty(w.scale.shape, np.float32)
    for i in range(k.shape[0]):
        for j in range(k.shape[1]):
            blk = v[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            u = np.float32(np.abs(blk).max() / np.float32(127))
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = np.clip(np.rint(blk / u), -127, 127) if u else 0
            k[i, j] = np.float32(np.float32(_scales64(w)[i, j]) * u)
    t, c = x.shape
    g = x.reshape(t, c // 32, 32)
    d = (np.abs(g).max(axis=2) / np.float32(127)).astype(np.float32)
    qa = np.clip(np.rint(g / np.where(d > 0, d, 1)[:, :, None]), -127, 127)
    y = np.zeros((t, w.rows))
    bounds = np.zeros((t, w.rows))  # sum of the group products' magnitudes
    for r in range(w.rows):
        kk = np.repeat(k[r // br], bc)[:c:32]  # the factor of each group of 32
        dd = (d * kk[None, :]).astype(np.float32).astype(np.float64)  # fl32(d * k), once per group
        sums = (qa * q[r].astype(np.float64).reshape(c // 32, 32)[None]).sum(axis=2)
        y[:, r] = (sums * dd).sum(axis=1)
        bounds[:, r] = (np.abs(sums) * dd).sum(axis=1)
    return q, k, y, bounds


@pytest.mark.parametrize(
    "rows, cols, block, f32",
    [
        (200, 256, (128, 128), False),
        (96, 192, (32, 32), False),
        (160, 128, (32, 32), True),
        (64, 1024, (128, 128), False),
    ],
)
def test_conversion_and_products_against_float64_of_the_same_roundings(rows, cols, block, f32):
    w = _fp8(rows + cols, rows, cols, block, f32)
    x = (np.random.default_rng(1).standard_t(3, (5, cols)) * 3).astype(np.float32)
    x[2, :32] = 0  # a zero group: d = 0
    q_ref, k_ref, y_ref, bound = _reference(w, x)
    q = trunkq8.quantize(w)
    assert q.kind == "i8" and q.data.dtype == np.int8 and q.scale.dtype == np.float32
    np.testing.assert_array_equal(q.data, q_ref)
    np.testing.assert_array_equal(q.scale, k_ref)
    y = trunkq8.matmul(q, x)
    # float32 sums of C/32 exact group products: a few float32 roundings of the summed magnitudes
    assert (np.abs(y - y_ref) <= 4e-6 * (cols // 32) * bound + 1e-30).all()


def test_in_place_conversion_reuses_the_bytes():
    w = _fp8(3, 128, 256, (128, 128))
    base = w.data.ctypes.data
    q = trunkq8.quantize(w, in_place=True)
    assert q.data.ctypes.data == base and q.data.nbytes == w.data.nbytes


def test_bits_do_not_depend_on_threads_tokens_or_the_form():
    w = trunkq8.quantize(_fp8(5, 512, 1024, (128, 128)))  # 1024 columns: the narrow one-token rows
    w3 = trunkq8.quantize(_fp8(6, 512, 1024, (128, 128)))
    x = np.random.default_rng(2).standard_normal((7, 1024)).astype(np.float32)
    n = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = trunkq8.matmul(w, x)
        numba.set_num_threads(max(2, n))
        two = trunkq8.matmul(w, x)
    finally:
        numba.set_num_threads(n)
    np.testing.assert_array_equal(one, two)
    for t in range(7):  # each token alone, and in calls of other token counts
        np.testing.assert_array_equal(trunkq8.matmul(w, x[t : t + 1])[0], one[t])
    np.testing.assert_array_equal(trunkq8.matmul(w, x[2:5]), one[2:5])
    y1, y3 = trunkq8.matmul_pair(w, w3, x[:3])
    np.testing.assert_array_equal(y1, one[:3])
    np.testing.assert_array_equal(y3, trunkq8.matmul(w3, x[:3]))
    # the grouped form: group i times rows i * 128 .. of one weight
    xg = np.random.default_rng(3).standard_normal((2, 4, 1024)).astype(np.float32)
    got = trunkq8.matmul_grouped(w, xg)
    for i in range(4):
        part = trunkq8.quantize(_fp8(5, 512, 1024, (128, 128)))
        part = QWeight("i8", part.data[i * 128 : (i + 1) * 128], part.scale[i : i + 1], 128, 1024, block=(128, 128))
        np.testing.assert_array_equal(got[:, i * 128 : (i + 1) * 128], trunkq8.matmul(part, xg[:, i]))


def test_nan_scales_make_their_rows_nan_and_nan_codes_keep_the_weight_fp8():
    w = _fp8(7, 256, 256, (128, 128))
    w.scale[1, 0] = 0xFF  # E8M0 NaN: rows 128..255
    x = np.random.default_rng(4).standard_normal((2, 256)).astype(np.float32)
    y = trunkq8.matmul(trunkq8.quantize(w), x)
    assert np.isnan(y[:, 128:]).all() and np.isfinite(y[:, :128]).all()
    wf = _fp8(8, 64, 128, (32, 32), f32_scales=True)
    wf.scale[0, 3] = np.inf  # an infinite float32 scale: rows 0..31 NaN too
    y = trunkq8.matmul(trunkq8.quantize(wf), x[:, :128])
    assert np.isnan(y[:, :32]).all() and np.isfinite(y[:, 32:]).all()
    bad = _fp8(9, 128, 128, (128, 128))
    bad.data[5, 7] = 0x7F  # an E4M3 NaN code: int8 cannot carry it
    assert trunkq8.quantize(bad) is None
    from dsv4stream.model.moe import ExpertWeights

    block = ExpertWeights(w1=bad, w2=_fp8(10, 128, 128, (128, 128)), w3=bad)
    trunkq8.convert_block(block)
    assert block.w1 is bad and block.w3 is bad and block.w2.kind == "i8"
    with pytest.raises(ValueError, match="unknown weight kind"):
        kernels._active().matmul(block.w2, x[:, :128])  # exact refuses it


def test_the_fast_engine_converts_its_trunk_only_when_asked(monkeypatch):
    import dataclasses

    import numerics_deviation as nd

    from dsv4stream.engine.session import Engine

    def kinds(eng):
        out = set()

        def walk(o):
            if isinstance(o, QWeight):
                out.add(o.kind)
            elif isinstance(o, tuple):
                for p in o:
                    walk(p)
            elif dataclasses.is_dataclass(o) and not isinstance(o, type):
                for f in dataclasses.fields(o):
                    walk(getattr(o, f.name))

        for i in range(eng.cfg.n_layers):
            walk(eng.trunk.layer(i))
        return out

    path = nd.FIXTURES / "mixed"
    ids = nd._oracle(path)["token_ids"][:12]
    try:
        monkeypatch.delenv(trunkq8.ENV, raising=False)
        off = Engine.open(path, numerics="fast")
        assert "i8" not in kinds(off)
        want = off.session().prefill(ids)
        monkeypatch.setenv(trunkq8.ENV, "1")
        on = Engine.open(path, numerics="fast")
        assert "i8" in kinds(on)  # (FP8 weights of 32 columns stay FP8: the rows take whole 64)
        got = on.session().prefill(ids)
        assert not np.array_equal(got, want)
        for mode in ("exact", "official"):  # only fast converts
            assert "i8" not in kinds(Engine.open(path, numerics=mode))
    finally:
        kernels.set_numerics("exact")


def test_fast_with_the_int8_trunk_is_as_close_as_official_on_two_fixtures(monkeypatch):
    import numerics_deviation as nd

    monkeypatch.setenv(trunkq8.ENV, "1")
    dev = nd.deviations(("official", "fast"), ("mixed", "clamp"))
    bad = {k: v for k, v in dev.items() if v["fast"][0] > v["official"][0] or v["fast"][1] < v["official"][1]}
    assert len(dev) == 4 and not bad, bad


@pytest.mark.parametrize("name, on", [("generic", False), ("haswell", True)])
def test_cpu_targets(name, on):
    env = {**os.environ, "NUMBA_CPU_NAME": name, "NUMBA_CPU_FEATURES": "", trunkq8.ENV: "1"}
    code = "from dsv4stream import kernels; print(kernels.int8_trunk())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, check=True)
    assert r.stdout.strip() == str(on)
