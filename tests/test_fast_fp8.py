"""The fast FP8 x BF16 kernel's layout and its one-region forms (kernels/bf16.py, kernels/numerics.py).

The AVX-512 kernel stores the activations in the order its in-lane byte unpacks leave the
decoded weights (`bf16._XPERM`) and rounds them in vector IR; a weight of one-hot rows reads
each rounded activation back at its own column, checked against ml_dtypes' rounding of x * s.
The shared expert's pair and the grouped output projection run as one parallel region each
(`bf16.fp8_matmul_pair`, `fp8_matmul_grouped`); each must equal its single products bit for
bit, and the router must take them (a driver call per group or per weight is the slow form
issue 44 measured).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dsv4stream import kernels
from dsv4stream.checkpoint import formats
from dsv4stream.kernels import QWeight, cpu

bf16 = pytest.importorskip("dsv4stream.kernels.bf16")

HOST = cpu.variant("fp8")
VARIANTS = [v for v in dict.fromkeys([HOST, "avx2"]) if v is not None]
needs_fast = pytest.mark.skipif(HOST is None, reason="no fast FP8 kernel variant for this CPU target")


@pytest.fixture
def fast_mode():
    kernels.set_numerics("fast")
    yield
    kernels.set_numerics("exact")


def one_hot(c: int, block: tuple[int, int], rng) -> QWeight:
    """E4M3 1.0 at (j, j) (identity), E8M0 scales 2^-4 .. 2^3 per block."""
    data = np.zeros((c, c), np.uint8)
    data[np.arange(c), np.arange(c)] = np.float32(1.0).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    scale = rng.integers(123, 131, (-(-c // block[0]), -(-c // block[1])), dtype=np.uint8)
    return QWeight("fp8", data, scale, c, c, block=block)


@needs_fast
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block", [(128, 128), (32, 32), (16, 48)], ids=["v4", "v41", "odd"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_each_column_meets_its_own_rounded_activation(block, variant, tokens):
    c = 384
    rng = np.random.default_rng(7)
    w = one_hot(c, block, rng)
    x = (rng.standard_normal((tokens, c)) * np.exp(rng.uniform(-20, 20, c))).astype(np.float32)
    # ties to even both ways, zeros; no infinity or NaN (0 * inf in the other columns is NaN)
    x[0, :6] = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 0.0, -0.0, 1.0]
    sc = np.repeat(np.repeat(formats.e8m0_to_f32(w.scale), block[0], 0)[:c], block[1], 1)[:c, :c]
    col_scale = sc[np.arange(c), np.arange(c)]  # row j's block scale at column j
    want = (x * col_scale).astype(ml_dtypes.bfloat16).astype(np.float32)
    got = bf16.fp8_matmul(w.data, w.scale, w.block, x, variant)
    np.testing.assert_array_equal(got, want)


def pair_weights(rng, rows: int, cols: int, block):
    def one():
        wf = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        return QWeight("fp8", *formats.quantize_fp8(wf, block=block), rows, cols, block=block)

    return one(), one()


@needs_fast
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block", [(128, 128), (32, 32)], ids=["v4", "v41"])
def test_pair_and_grouped_drivers_equal_single_products(block, variant):
    rng = np.random.default_rng(8)
    w1, w3 = pair_weights(rng, 262, 256, block)  # 262 rows: a partial block and a 4-row tail
    for t in (1, 2, 5):
        x = rng.standard_normal((t, 256)).astype(np.float32)
        a, b = bf16.fp8_matmul_pair(w1, w3, x, variant)
        np.testing.assert_array_equal(a, bf16.fp8_matmul(w1.data, w1.scale, block, x, variant))
        np.testing.assert_array_equal(b, bf16.fp8_matmul(w3.data, w3.scale, block, x, variant))
        for u in range(t):  # the one-token kernel (4 rows a pass) gives each row's bits
            one = bf16.fp8_matmul(w1.data, w1.scale, block, x[u], variant)[0]
            np.testing.assert_array_equal(one, a[u])
    big, _ = pair_weights(rng, 4 * 128, 256, block)
    xg = rng.standard_normal((2, 4, 256)).astype(np.float32)
    got = bf16.fp8_matmul_grouped(big.data, big.scale, block, xg, variant)
    for i in range(4):
        rows = slice(128 * i, 128 * i + 128)
        srows = slice(128 * i // block[0], (128 * i + 128) // block[0])
        part = bf16.fp8_matmul(big.data[rows], np.ascontiguousarray(big.scale[srows]), block, xg[:, i], variant)
        np.testing.assert_array_equal(got[:, rows], part)


@needs_fast
def test_router_runs_the_pair_and_the_groups_in_one_region(fast_mode, monkeypatch):
    drives: list[str] = []
    real = bf16._drive
    monkeypatch.setattr(bf16, "_drive", lambda kind, variant: drives.append(kind) or real(kind, variant))
    rng = np.random.default_rng(9)
    w1, w3 = pair_weights(rng, 256, 512, (128, 128))
    x = rng.standard_normal((1, 512)).astype(np.float32)
    a, b = kernels.matmul_pair(w1, w3, x)
    assert drives == ["fp8pair"]
    big, _ = pair_weights(rng, 4 * 128, 512, (128, 128))
    ws = [
        QWeight("fp8", big.data[128 * i : 128 * i + 128], big.scale[i : i + 1], 128, 512, block=(128, 128))
        for i in range(4)
    ]
    xg = rng.standard_normal((1, 4, 512)).astype(np.float32)
    drives.clear()
    got = kernels.matmul_grouped(ws, xg)
    assert drives == ["fp8"]
    drives.clear()
    singles = [kernels.matmul(w, xg[:, i]) for i, w in enumerate(ws)]
    np.testing.assert_array_equal(got, np.concatenate(singles, axis=1))
    np.testing.assert_array_equal(a, kernels.matmul(w1, x))
    np.testing.assert_array_equal(b, kernels.matmul(w3, x))


def narrow_rows_check(variant: str) -> None:
    """One token through the one-token kernel (4 rows a pass, prefetching the next pass's rows)
    and two through the two-token kernel (2 rows a pass, prefetching), on narrow rows, row
    counts that end mid-pass and mid-block, FP8 and BF16 weights: each row equals the same row
    of a 3-token call (another kernel: one row a pass, no prefetch) bit for bit, and float64
    within BF16 rounding."""
    rng = np.random.default_rng(11)
    for rows, cols in ((262, 1024), (131, 2048), (7, 64)):
        wf = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        w = QWeight("fp8", *formats.quantize_fp8(wf, block=(128, 128)), rows, cols, block=(128, 128))
        hb = wf.astype(ml_dtypes.bfloat16).view(np.uint16)
        x = rng.standard_normal((3, cols)).astype(np.float32)
        three = bf16.fp8_matmul(w.data, w.scale, w.block, x, variant)
        three_b = bf16.bf16_matmul(hb, x, variant)
        two = bf16.fp8_matmul(w.data, w.scale, w.block, x[:2], variant)
        np.testing.assert_array_equal(two, three[:2])
        np.testing.assert_array_equal(bf16.bf16_matmul(hb, x[1:], variant), three_b[1:])
        for t in range(3):
            one = bf16.fp8_matmul(w.data, w.scale, w.block, x[t], variant)[0]
            np.testing.assert_array_equal(one, three[t])
            np.testing.assert_array_equal(bf16.bf16_matmul(hb, x[t : t + 1], variant)[0], three_b[t])
        ref = x.astype(np.float64) @ kernels.dense(w).astype(np.float64).T
        bound = 2**-7 * (np.abs(x) @ np.abs(kernels.dense(w)).T) + 1e-6
        assert np.all(np.abs(three - ref) <= bound)


@needs_fast
@pytest.mark.parametrize("variant", VARIANTS)
def test_narrow_rows_one_token_with_the_next_pass_prefetched(variant):
    narrow_rows_check(variant)


def test_only_the_one_and_two_token_pass_kernels_prefetch(monkeypatch):
    # the prefetch changes no arithmetic, so no result can show it: check what `_driver` builds
    made = []
    real = bf16._row_intrinsic
    monkeypatch.setattr(bf16, "_row_intrinsic", lambda *a, **k: made.append((a, k)) or real(*a, **k))
    bf16._driver("fp8", "avx2")  # builds the dispatcher only; nothing compiles until a call
    pf = [(a[2], a[3] if len(a) > 3 else 1, k.get("prescaled", False)) for a, k in made if k.get("prefetch")]
    # a kernel per token group of 1 .. MAX_GROUP tokens and the one- and two-token pass kernels,
    # twice: BF16 activations and AVX2's prescaled ones
    one, two = (1, bf16.ONE_TOKEN_ROWS), (2, bf16.TWO_TOKEN_ROWS)
    assert pf == [(*one, False), (*two, False), (*one, True), (*two, True)]
    assert len(made) == 2 * (bf16.MAX_GROUP["avx2"] + 2)
    assert sum(k.get("prescaled", False) for _, k in made) == bf16.MAX_GROUP["avx2"] + 2


@needs_fast
def test_narrow_rows_on_the_avx2_target_in_a_child():
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}
    root = Path(__file__).parents[1]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), str(root / "tests"), env.get("PYTHONPATH")) if p)
    code = (
        "from dsv4stream.kernels import cpu\n"
        "assert cpu.variant('fp8') == 'avx2', cpu.variant('fp8')\n"
        "import test_fast_fp8 as t\n"
        "t.narrow_rows_check('avx2')\n"
        "print('ok')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]


@needs_fast
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_nan_codes_rerun_their_pass_with_the_same_bits(variant, tokens):
    # AVX2 decodes E4M3 without the NaN select and reruns a pass that met a NaN code (0x7F /
    # 0xFF) with it: that pass's NaN rows come out NaN, and its other rows keep the bits they
    # have in a weight with no NaN at all (every code but NaN, subnormals included).
    rng = np.random.default_rng(12)
    rows, cols = 70, 320
    data = rng.integers(0, 0x7F, (rows, cols), dtype=np.uint8) | (rng.integers(0, 2, (rows, cols), dtype=np.uint8) << 7)
    scale = rng.integers(120, 130, (-(-rows // 32), cols // 32), dtype=np.uint8)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    clean = bf16.fp8_matmul(data, scale, (32, 32), x, variant)
    assert np.isfinite(clean).all()
    dirty = data.copy()
    nan_rows = [1, 6, 69]  # in the first pass, the second, the last (a single-row tail)
    dirty[nan_rows, [5, 300, 63]] = [0x7F, 0xFF, 0x7F]
    got = bf16.fp8_matmul(dirty, scale, (32, 32), x, variant)
    assert np.isnan(got[:, nan_rows]).all()
    keep = np.setdiff1d(np.arange(rows), nan_rows)
    np.testing.assert_array_equal(got[:, keep].view(np.uint32), clean[:, keep].view(np.uint32))


@needs_fast
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block", [(128, 128), (32, 32)], ids=["v4", "v41"])
@pytest.mark.parametrize("tokens", [1, 3, 6])
def test_rows_meet_their_activation_whichever_form_takes_the_block(block, variant, tokens):
    # AVX2's kernels take a row block's activations times 2^120 in float32 where each
    # |bf16(x * s)| < 2^8 (every token of the call) and the BF16 form elsewhere: row blocks of
    # both kinds (the last block's scales push x * s past 2^8), values down to BF16
    # subnormals, ties to even; 3 and 6 tokens run the token-group kernels (6 = 4 + 2 on AVX2).
    c = 384
    rng = np.random.default_rng(13)
    w = one_hot(c, block, rng)
    w.scale[:] = 126
    w.scale[-1, :] = 134  # x 2^7: the last row block sees values up to 2^8 and beyond
    x = (rng.standard_normal((tokens, c)) * np.exp2(rng.uniform(-140, 1, c))).astype(np.float32)
    x[0, :5] = [1 + 2**-8, 1 + 3 * 2**-8, 0.0, -0.0, 3.99]
    x[-1, -3:] = [3.999, -3.99, 4.0]  # x 2^7 in the last block: 511.9, -510.7, 512 (too large for 2^120)
    sc = np.repeat(np.repeat(formats.e8m0_to_f32(w.scale), block[0], 0)[:c], block[1], 1)[:c, :c]
    want = (x * sc[np.arange(c), np.arange(c)]).astype(ml_dtypes.bfloat16).astype(np.float32)
    got = bf16.fp8_matmul(w.data, w.scale, w.block, x, variant)
    np.testing.assert_array_equal(got, want)
    assert (np.abs(want[:, : -block[0]]) < 2**8).all() and np.abs(want[:, -block[0] :]).max() >= 2**8
