"""Fused numba kernels (kernels/fast.py and the fp4 / fp8 / plain kernels it dispatches to) against a float64 reference built here.

The reference dequantises with `formats` (ml_dtypes codecs, widened to float64) and multiplies
in float64: it shares nothing with the kernels' bit-level decoding. Error metric: max |ours -
ref| / max |ref| over an output (T, R), required <= 1e-6; the edge-scale test applies it to
each group of rows separately (2^-127 rows, 2^+20 rows, mixed rows), so tiny rows are held to
the same standard. First run compiles the kernels (tens of seconds); numba's on-disk cache
makes later runs fast.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import numba
import numpy as np
import pytest

from dsv4stream.checkpoint import formats
from dsv4stream.kernels import QWeight

fast = pytest.importorskip("dsv4stream.kernels.fast")
from dsv4stream.kernels import fp4, jit, warm  # after the importorskip: they need numba

TOL = 1e-6
PREFILL_TOKENS = 512  # a prefill segment's worth of tokens for one expert


def dense64(w: QWeight) -> np.ndarray:
    if w.kind == "fp4":
        vals = formats.unpack_fp4(w.data).astype(np.float64)
        s = formats.scale_to_f32(w.scale).astype(np.float64)
        return vals * np.repeat(s, 32, axis=1)
    if w.kind == "fp8":
        vals = formats.e4m3_to_f32(w.data).astype(np.float64)
        s = formats.scale_to_f32(w.scale).astype(np.float64)
        br, bc = w.block
        return vals * np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[: w.rows, : w.cols]
    if w.kind == "bf16":
        return formats.bf16_to_f32(w.data).astype(np.float64)
    return w.data.astype(np.float64)


def reference(x: np.ndarray, w: QWeight) -> np.ndarray:
    return np.atleast_2d(x).astype(np.float64) @ dense64(w).T


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(np.atleast_2d(got) - ref).max() / np.abs(ref).max())


def weight(kind: str, rows: int, cols: int, rng, scale_kind: str = "e8m0", exps=(118, 131)) -> QWeight:
    """Random codes (no NaN codes) and random block scales 2^e for e in exps (or a range).

    kind "fp8/32" is FP8 with DeepSeek-V4.1's 32x32 scale blocks ("fp8": V4's 128x128)."""
    block = 32 if kind == "fp8/32" else 128
    kind = "fp8" if kind == "fp8/32" else kind
    if kind == "bf16":
        return QWeight(kind, formats.f32_to_bf16(rng.standard_normal((rows, cols))), None, rows, cols)
    if kind == "f32":
        return QWeight(kind, rng.standard_normal((rows, cols)).astype(np.float32), None, rows, cols)
    if kind == "fp4":
        data = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        shape = (rows, cols // 32)
    else:
        data = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
        data[(data & 0x7F) == 0x7F] = 0x38
        # subnormal codes only in every 5th row: a uniform byte is subnormal 1 time in 18, which
        # would send every 32-byte group down the vector decode's slow path (`fp8._decoded32`)
        sub = ((data & 0x78) == 0) & ((data & 0x07) != 0)
        sub[::5] = False
        data[sub] |= 0x08
        shape = (-(-rows // block), -(-cols // block))
    if isinstance(exps, tuple):
        scale = rng.integers(exps[0], exps[1], shape).astype(np.uint8)
    else:
        scale = rng.choice(np.asarray(exps, np.uint8), shape)
    if scale_kind == "f32":
        scale = formats.e8m0_to_f32(scale) * rng.uniform(0.5, 1.0, shape).astype(np.float32)
    return QWeight(kind, data, scale, rows, cols, block=(block, block))


SHAPES = [
    ("fp4", 64, 256),
    ("fp4", 37, 96),
    ("fp4", 33, 1088),  # two full column chunks of the matmul tile and a ragged third
    ("fp8", 130, 200),  # rows and cols not multiples of 128
    ("fp8", 3, 1),
    ("fp8", 64, 1100),  # several column chunks of the matmul tile, ragged end
    ("fp8/32", 70, 200),  # V4.1's 32x32 blocks: rows and cols not multiples of 32
    ("fp8/32", 96, 1100),
    ("bf16", 33, 45),
    ("f32", 7, 70),
]


@pytest.mark.parametrize("kind,rows,cols", SHAPES)
@pytest.mark.parametrize("scale_kind", ["e8m0", "f32"])
def test_accuracy_against_float64(kind, rows, cols, scale_kind):
    rng = np.random.default_rng(rows * 1000 + cols)
    w = weight(kind, rows, cols, rng, scale_kind)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    ref = reference(x, w)
    assert rel_error(fast.matmul(w, x), ref) <= TOL
    assert rel_error(fast.matvec(w, x[0]), ref[:1]) <= TOL


@pytest.mark.parametrize(("rows", "cols"), [(2048, 4096), (4096, 2048)])
def test_fp4_at_the_real_flash_expert_shapes(rows, cols):
    """V4-Flash's routed experts: w1/w3 are 2048 x 4096 FP4, w2 4096 x 2048 (8 and 4 column
    chunks of the matmul tile); decode (matvec) and a few tokens (matmul)."""
    rng = np.random.default_rng(rows + 7 * cols)
    w = weight("fp4", rows, cols, rng)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    ref = reference(x, w)
    assert rel_error(fast.matmul(w, x), ref) <= TOL
    assert rel_error(fast.matvec(w, x[0]), ref[:1]) <= TOL


@pytest.mark.parametrize("kind", ["fp4", "fp8", "fp8/32"])
@pytest.mark.parametrize("scale_kind", ["e8m0", "f32"])
def test_edge_scales(kind, scale_kind):
    """E8M0 byte 0 (2^-127, a float32 subnormal) next to 2^+20, whole rows of each, and mixes."""
    rng = np.random.default_rng(7)
    rows, cols = (384, 640) if kind.startswith("fp8") else (12, 256)
    w = weight(kind, rows, cols, rng, scale_kind, exps=[0, 1, 2, 127, 147])
    tiny, big = (np.float32(2.0**-127), np.float32(2.0**20)) if scale_kind == "f32" else (0, 147)
    w.scale[0] = tiny  # FP4: row 0; FP8: rows 0..127 (0..31 with 32x32 blocks)
    w.scale[1] = big
    x = rng.standard_normal((16, cols)).astype(np.float32)
    got, ref = fast.matmul(w, x), reference(x, w)
    assert np.isfinite(got).all()
    block = 1 if kind == "fp4" else w.block[0]
    for rows_ in (slice(0, block), slice(block, 2 * block), slice(2 * block, None)):
        assert rel_error(got[:, rows_], ref[:, rows_]) <= TOL
    assert 0 < np.abs(got[:, :block]).max() < 1e-30  # 2^-127 rows really computed, not flushed


def test_nan_scale_and_nan_codes_poison_their_rows_only():
    rng = np.random.default_rng(3)
    w4 = weight("fp4", 8, 64, rng)
    w4.scale[2, 1] = 0xFF  # E8M0 NaN
    x = rng.standard_normal((3, 64)).astype(np.float32)
    got = fast.matmul(w4, x)
    assert np.isnan(got[:, 2]).all() and np.isfinite(np.delete(got, 2, axis=1)).all()
    assert np.isnan(fast.matvec(w4, x[0])[2])

    w8 = weight("fp8", 200, 64, rng)
    w8.data[5, 7] = 0x7F  # E4M3 NaN code
    w8.scale[1, 0] = 0xFF  # rows 128..199
    got = fast.matmul(w8, x)
    bad = np.zeros(200, bool)
    bad[5] = True
    bad[128:] = True
    assert np.isnan(got[:, bad]).all() and np.isfinite(got[:, ~bad]).all()


def test_matvec_equals_matmul_rows_bit_for_bit():
    """Prefill rows (decode, short chunks, a segment's worth) equal step-by-step matvecs."""
    rng = np.random.default_rng(11)
    for kind, rows, cols in SHAPES:
        for scale_kind in ("e8m0", "f32"):
            w = weight(kind, rows, cols, rng, scale_kind)
            n = PREFILL_TOKENS - 1
            x = rng.standard_normal((n, cols)).astype(np.float32)
            y = fast.matmul(w, x)
            for t in (0, 1, n // 2, n - 1):
                assert np.array_equal(fast.matvec(w, x[t]), y[t]), (kind, scale_kind, t)
            assert np.array_equal(fast.matmul(w, x[3:6]), y[3:6])


@pytest.mark.parametrize("kind,cols", [("fp4", 1056), ("fp8", 1152), ("fp8/32", 1120), ("bf16", 1040)])
def test_a_token_has_the_same_bits_at_every_count_and_place_in_a_register_block(kind, cols):
    """Tokens go through the matmul kernels in blocks of TOKS (padded with zero rows) and columns
    in chunks of CHUNK: a row's result may depend on neither, since prefill segments (sized from
    --budget) give an expert any number of tokens. cols leaves a short last chunk (FP4: one
    32-block, lanes 0-15 only)."""
    rng = np.random.default_rng(14)
    w = weight(kind, 9, cols, rng)
    x = rng.standard_normal((2 * fast.TOKS + 2, cols)).astype(np.float32)
    want = np.stack([fast.matvec(w, v) for v in x])
    for t in range(2, len(x) + 1):
        for start in range(len(x) - t + 1):
            assert np.array_equal(fast.matmul(w, x[start : start + t]), want[start : start + t]), (t, start)


def test_fused_matmul_splits_long_inputs_exactly():
    """Past MAX_TOKENS the fused path splits X; each part gives the same bits as alone."""
    rng = np.random.default_rng(12)
    w = weight("fp4", 37, 96, rng)
    x = rng.standard_normal((fast.MAX_TOKENS + 6, 96)).astype(np.float32)
    y = fast.matmul(w, x)
    assert np.array_equal(y[fast.MAX_TOKENS :], fast.matmul(w, x[fast.MAX_TOKENS :]))
    assert np.array_equal(fast.matvec(w, x[-1]), y[-1])


@pytest.mark.parametrize("kind,rows,cols", [*SHAPES, ("fp4", 300, 2048), ("fp8", 257, 640)])
@pytest.mark.parametrize("scale_kind", ["e8m0", "f32"])
def test_prefill_sized_matmul_accuracy_and_agreement_with_matvec(kind, rows, cols, scale_kind):
    """Prefill-sized token counts (several MAX_TOKENS calls, a ragged last one): as accurate as
    one token, and within float32 rounding of the per-token matvecs."""
    rng = np.random.default_rng(rows + cols)
    w = weight(kind, rows, cols, rng, scale_kind)
    x = rng.standard_normal((PREFILL_TOKENS + 3, cols)).astype(np.float32)
    got, ref = fast.matmul(w, x), reference(x, w)
    assert rel_error(got, ref) <= TOL
    fused = np.stack([fast.matvec(w, row) for row in x])
    assert rel_error(got, fused.astype(np.float64)) <= TOL


@pytest.mark.parametrize("kind", ["fp4", "fp8"])
def test_prefill_sized_edge_and_nan_scales(kind):
    rng = np.random.default_rng(8)
    rows, cols = (384, 640) if kind == "fp8" else (12, 256)
    w = weight(kind, rows, cols, rng, exps=[0, 1, 2, 127, 147])
    w.scale[0] = 0
    w.scale[1] = 147
    w.scale[2, 0] = 0xFF
    x = rng.standard_normal((PREFILL_TOKENS, cols)).astype(np.float32)
    got, ref = fast.matmul(w, x), reference(x, w)
    block = 1 if kind == "fp4" else 128
    for rows_ in (slice(0, block), slice(block, 2 * block)):
        assert rel_error(got[:, rows_], ref[:, rows_]) <= TOL
    assert 0 < np.abs(got[:, :block]).max() < 1e-30
    assert np.isnan(got[:, 2 * block : 3 * block]).all() and np.isfinite(got[:, : 2 * block]).all()


def test_pair_and_grouped_equal_the_separate_products():
    rng = np.random.default_rng(5)
    for kind, rows, cols in (("fp4", 64, 128), ("fp8", 256, 384), ("fp8/32", 96, 160)):
        w1, w3 = weight(kind, rows, cols, rng), weight(kind, rows, cols, rng)
        x = rng.standard_normal((1, cols)).astype(np.float32)
        g, u = fast.matmul_pair(w1, w3, x)
        assert np.array_equal(g[0], fast.matvec(w1, x[0])) and np.array_equal(u[0], fast.matvec(w3, x[0]))
        xs = rng.standard_normal((5, cols)).astype(np.float32)
        g, u = fast.matmul_pair(w1, w3, xs)
        assert np.array_equal(g, fast.matmul(w1, xs)) and np.array_equal(u, fast.matmul(w3, xs))
    # the grouped output projection: row blocks of one tensor, each meeting its own input
    from dsv4stream.weights.loading import split_rows

    for kind, rows, cols, groups in (
        ("fp8", 1024, 256, 4),
        ("fp8/32", 256, 96, 8),
        ("f32", 96, 64, 3),
        ("bf16", 40, 48, 2),
    ):
        parts = split_rows(weight(kind, rows, cols, rng), groups)
        x = rng.standard_normal((1, groups, cols)).astype(np.float32)
        want = np.concatenate([fast.matvec(p, x[0, i]) for i, p in enumerate(parts)])
        assert np.array_equal(fast.matmul_grouped(parts, x)[0], want), kind
        xs = rng.standard_normal((3, groups, cols)).astype(np.float32)
        want = np.concatenate([fast.matmul(p, xs[:, i]) for i, p in enumerate(parts)], axis=1)
        assert np.array_equal(fast.matmul_grouped(parts, xs), want)
    # blocks that are not one tensor's rows still multiply correctly (one product per group)
    loose = (weight("fp8", 128, 64, rng), weight("fp8", 128, 64, rng))
    x = rng.standard_normal((1, 2, 64)).astype(np.float32)
    want = np.concatenate([fast.matvec(p, x[0, i]) for i, p in enumerate(loose)])
    assert np.array_equal(fast.matmul_grouped(loose, x)[0], want)


def test_serial_and_parallel_matvec_agree(monkeypatch):
    rng = np.random.default_rng(9)
    cases = [weight(k, r, c, rng, sk) for k, r, c in SHAPES for sk in ("e8m0", "f32")]
    outs = []
    for floor in (0, 1 << 62):
        monkeypatch.setattr(fast, "PARALLEL_MIN_BYTES", floor)
        outs.append([fast.matvec(w, np.ones(w.cols, np.float32) / 3) for w in cases])
    for a, b in zip(*outs):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("rows,cols,rpg", [(24, 16384, 24), (4, 16384, 4), (7, 100, 7), (13, 64, 5), (9, 31, 3)])
def test_plain_matvec_passes_of_rows_have_each_rows_bits(kind, rows, cols, rpg):
    """`plain._plain_mv(_serial)` take MV_ROWS rows a pass in vector IR (ragged ends, groups that
    split a pass and columns past the last 32 row by row): every row equals `_plain_row`'s loop,
    serial and parallel, and the float64 reference."""
    from numba import carray, njit

    from dsv4stream.kernels import plain
    from dsv4stream.kernels.jit import _stack_f32

    lanes = plain.LANES

    @njit(cache=False)
    def row_by_row(w, x, rpg, out):
        acc = carray(_stack_f32(lanes), (lanes,))
        for r in range(w.shape[0]):
            out[r] = plain._plain_row(w, r, x[r // rpg], acc)

    rng = np.random.default_rng(rows * cols)
    w = weight(kind, rows, cols, rng)
    data = fast._plain(w)
    x = rng.standard_normal((-(-rows // rpg), cols)).astype(np.float32)
    want = np.empty(rows, np.float32)
    row_by_row(data, x, rpg, want)
    for kernel in (plain._plain_mv_serial, plain._plain_mv):
        got = np.empty(rows, np.float32)
        kernel(data, x, rpg, got)
        assert got.tobytes() == want.tobytes()
    parts = [w.data[g * rpg : (g + 1) * rpg] for g in range(len(x))]
    ref = np.concatenate([reference(x[g], QWeight(kind, p, None, len(p), cols))[0] for g, p in enumerate(parts)])
    assert rel_error(want, ref[None]) <= TOL


@pytest.mark.parametrize("rows,cols", [(130, 200), (3, 1), (64, 1100), (258, 8192), (512, 8192)])
@pytest.mark.parametrize("scale_kind", ["e8m0", "f32"])
@pytest.mark.parametrize("kind", ["fp8", "fp8/32"])
def test_wide_fp8_matvec_takes_rows_together_with_the_same_bits(rows, cols, scale_kind, kind, monkeypatch):
    """Rows of >= WIDE_COLS columns go MV_ROWS at a time (ragged row counts end row by row)."""
    rng = np.random.default_rng(rows + cols)
    w = weight(kind, rows, cols, rng, scale_kind)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    monkeypatch.setattr(fast, "PARALLEL_MIN_BYTES", 0)
    narrow = [fast.matvec(w, x[t]) for t in range(3)]
    monkeypatch.setattr(fast, "WIDE_COLS", 1)
    wide = [fast.matvec(w, x[t]) for t in range(3)]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(narrow, wide))
    assert rel_error(np.stack(wide), reference(x, w)) <= TOL
    assert np.array_equal(np.stack(wide), fast.matmul(w, x))
    if rows == 512:  # grouped rows (the joined output projection): 2 groups of 256 rows, 4 of 128
        from dsv4stream.weights.loading import split_rows

        for groups in (2, 4):
            parts = split_rows(w, groups)
            xg = rng.standard_normal((1, groups, cols)).astype(np.float32)
            want = np.concatenate([fast.matvec(p, xg[0, i]) for i, p in enumerate(parts)])
            assert np.array_equal(fast.matmul_grouped(parts, xg)[0], want)


def _fp8_groups(rng, rows: int, cols: int) -> np.ndarray:
    """E4M3 codes whose 32-byte groups are of four kinds, by group: no subnormal or NaN code (the
    vector decode's direct path, half of them), one subnormal code, or zeros and -0 among normal codes; every
    6th row has one NaN code (0x7F or 0xFF) in one group."""
    d = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    d[((d & 0x78) == 0) & ((d & 0x07) != 0)] |= 0x08
    d[(d & 0x7F) == 0x7F] = 0x38
    for r in range(rows):
        for j in range(0, cols, 32):
            kind, at = rng.integers(0, 4), j + rng.integers(0, min(32, cols - j))
            if kind == 1:
                d[r, at] = rng.integers(1, 8) | (rng.integers(0, 2) << 7)
            elif kind == 2:
                d[r, at : at + 3] = rng.choice([0x00, 0x80])
        if r % 6 == 1:
            d[r, rng.integers(0, cols)] = rng.choice([0x7F, 0xFF])
    return d


@pytest.mark.parametrize(
    "rows,cols,block", [(96, 256, 128), (37, 1000, 128), (64, 288, 32), (9, 8224, 128), (40, 160, 64)]
)
@pytest.mark.parametrize("scale_kind", ["e8m0", "e8m0-wide", "f32-wide"])
def test_fp8_vector_decode_paths_have_the_scalar_decodes_bits(rows, cols, block, scale_kind, monkeypatch):
    """`fp8._decoded32` decodes a 32-byte group straight into float32 bits unless it holds a
    subnormal or NaN code (then through float16, as the scalar `_e4m3`). Every FP8 product with
    blocks a multiple of 32 wide goes through it: matvec (serial, parallel, the wide rows, the pair),
    2-3 tokens and the tile. Each must give the generic kernel's bits (`_fp8_mv_serial`: the
    scalar decode), NaN exactly where a NaN code or scale is, and the float64 reference elsewhere.
    E8M0 scales from 2^-127 to 2^100 (flushed blocks, rel at both ends; the sums stay finite) and
    float32 scales down to subnormals; x with tiny entries (products below float32 normals)."""
    rng = np.random.default_rng(rows * 31 + cols + block)
    data = _fp8_groups(rng, rows, cols)
    shape = (-(-rows // block), -(-cols // block))
    if scale_kind == "e8m0":
        scale = rng.integers(116, 133, shape).astype(np.uint8)
    elif scale_kind == "e8m0-wide":
        scale = rng.integers(0, 228, shape).astype(np.uint8)  # up to 2^100: the sums stay finite
    else:
        scale = (rng.uniform(0.5, 1.0, shape) * 2.0 ** rng.integers(-149, 100, shape)).astype(np.float32)
    w = QWeight("fp8", data, scale, rows, cols, block=(block, block))
    w2 = QWeight("fp8", _fp8_groups(rng, rows, cols), scale.copy(), rows, cols, block=(block, block))
    x = rng.standard_normal((3, cols)).astype(np.float32)
    x[:, ::5] *= np.float32(1e-35)

    def generic(wt, xt):
        out = np.empty(wt.rows, np.float32)
        fast._fp8_mv_serial(fast._u8(wt.data), fast._scale(wt), *wt.block, fast._aligned_copy(xt[None]), wt.rows, out)
        return out

    want = np.stack([generic(w, x[t]) for t in range(3)])
    want2 = np.stack([generic(w2, x[t]) for t in range(3)])
    nan_rows = np.isnan(dense64(w) @ np.ones(cols))  # a NaN code or scale in the row
    assert np.array_equal(np.isnan(want), np.broadcast_to(nan_rows, want.shape))
    ok = ~nan_rows
    assert rel_error(want[:, ok], reference(x, w)[:, ok]) <= TOL
    for floor in (0, 1 << 62):  # parallel and serial
        monkeypatch.setattr(fast, "PARALLEL_MIN_BYTES", floor)
        for wide in (1, 1 << 30):
            monkeypatch.setattr(fast, "WIDE_COLS", wide)
            got = np.stack([fast.matvec(w, x[t]) for t in range(3)])
            assert got.tobytes() == want.tobytes(), (floor, wide)
        y1, y2 = fast.matmul_pair(w, w2, x[:1])
        assert y1.tobytes() == want[:1].tobytes() and y2.tobytes() == want2[:1].tobytes()
    monkeypatch.setattr(fast, "PARALLEL_MIN_BYTES", 0)
    for t in (2, 3):  # `_fp8_mvt` (its own decode call) and the tile from 4 tokens
        assert fast.matmul(w, x[:t]).tobytes() == want[:t].tobytes()
    xs = np.concatenate([x] * 3)[:7]
    assert fast.matmul(w, xs).tobytes() == np.concatenate([want] * 3)[:7].tobytes()


@pytest.mark.parametrize("rows,cols", [(64, 256), (37, 96), (130, 1088)])
@pytest.mark.parametrize("scale_kind", ["e8m0", "f32"])
def test_fp4_few_token_kernels_have_each_tokens_matvec_bits(rows, cols, scale_kind, monkeypatch):
    """2 or 3 tokens (a routed expert in a short prompt) decode each FP4 byte once for all of them
    (`_fp4_mvt`, `_fp4_mvt2`); each token's row is still its matvec, bit for bit, and a NaN scale
    poisons only its row. cols 96: an odd number of 16-byte blocks per row."""
    rng = np.random.default_rng(rows + cols)
    w1, w3 = weight("fp4", rows, cols, rng, scale_kind), weight("fp4", rows, cols, rng, scale_kind)
    w1.scale[5, 1] = np.nan if scale_kind == "f32" else 0xFF
    monkeypatch.setattr(fast, "PARALLEL_MIN_BYTES", 0)
    for t in (2, 3):
        x = rng.standard_normal((t, cols)).astype(np.float32)
        per = [np.stack([fast.matvec(w, x[k]) for k in range(t)]) for w in (w1, w3)]
        got = fast.matmul(w1, x)
        assert got.tobytes() == per[0].tobytes()
        y1, y3 = fast.matmul_pair(w1, w3, x)
        assert y1.tobytes() == per[0].tobytes() and y3.tobytes() == per[1].tobytes()
        assert np.isnan(got[:, 5]).all() and not np.isnan(np.delete(got, 5, axis=1)).any()
        assert rel_error(np.delete(y3, 5, axis=1), np.delete(reference(x, w3), 5, axis=1)) <= TOL
    assert fast._fp4_mvt.signatures and fast._fp4_mvt2.signatures  # the few-token kernels ran


@pytest.mark.parametrize(
    "kind,rows,cols,scale_kind",
    [
        ("fp8", 256, 256, "e8m0"),  # V4's blocks
        ("fp8", 300, 4000, "f32"),  # 4000 columns: a ragged last block, still whole 32-column groups
        ("fp8/32", 96, 320, "e8m0"),  # V4.1's blocks
        ("fp8", 130, 1000, "e8m0"),  # 1000 columns: not whole groups, one matvec per token
    ],
)
def test_fp8_at_a_few_tokens_gives_each_tokens_matvec(kind, rows, cols, scale_kind, monkeypatch):
    """FP8 products of 2 to a dozen tokens, alone and as a pair, equal the one-token matvec per
    token bit for bit, whichever kernel takes them; a NaN scale poisons only its block's rows;
    `_fp8_mvt` takes exactly the counts `_fp8_few` names (the tile kernel is not reached)."""
    rng = np.random.default_rng(rows * 7 + cols)
    w1, w3 = weight(kind, rows, cols, rng, scale_kind), weight(kind, rows, cols, rng, scale_kind)
    w1.scale[1, 0] = np.nan if scale_kind == "f32" else 0xFF
    br = w1.block[0]
    monkeypatch.setattr(fast, "_parallel", lambda w: True)  # whatever thread count an earlier test left
    calls = []
    for name in ("_fp8_mvt", "_fp8_mvt2"):
        kernel = getattr(fast, name)
        monkeypatch.setattr(fast, name, lambda *a, k=kernel, n=name: (calls.append(n), k(*a)))
    whole = cols % 32 == 0
    most = fast.FP8_FEW
    for t in (2, 3, 4, 5, 7, 10, 13):
        x = rng.standard_normal((t, cols)).astype(np.float32)
        per = [np.stack([fast.matvec(w, x[k]) for k in range(t)]) for w in (w1, w3)]
        calls.clear()
        got = fast.matmul(w1, x)
        y1, y3 = fast.matmul_pair(w1, w3, x)
        assert got.tobytes() == per[0].tobytes(), t
        assert y1.tobytes() == per[0].tobytes() and y3.tobytes() == per[1].tobytes(), t
        assert calls == (["_fp8_mvt", "_fp8_mvt2"] if whole and t <= most else []), t
        bad = np.isnan(got).any(axis=0)
        assert bad[br : 2 * br].all() and not bad[:br].any() and not bad[2 * br :].any()
        assert rel_error(y3, reference(x, w3)) <= TOL


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 cores")
def test_results_do_not_depend_on_thread_count():
    rng = np.random.default_rng(13)
    cases = [weight(k, r, c, rng, sk) for k, r, c in SHAPES for sk in ("e8m0", "f32")]
    xs = [rng.standard_normal((PREFILL_TOKENS + 2, w.cols)).astype(np.float32) for w in cases]
    before = fast.get_threads()
    try:
        runs = []
        for n in (1, 2):
            assert fast.set_threads(n) == n
            runs.append([(fast.matmul(w, x[:5]), fast.matvec(w, x[0]), fast.matmul(w, x)) for w, x in zip(cases, xs)])
    finally:
        fast.set_threads(before)
    for a, b in zip(*runs):
        assert all(p.tobytes() == q.tobytes() for p, q in zip(a, b))


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 cores")
def test_thread_setting_holds_in_other_threads():
    """numba's count is per thread; set_threads must reach kernels called from a worker thread."""
    w = weight("fp8", 8, 32, np.random.default_rng(1))
    before = fast.get_threads()
    seen = []

    def work():
        fast.matvec(w, np.ones(32, np.float32))
        seen.append(fast.get_threads())

    try:
        fast.set_threads(1)
        t = threading.Thread(target=work)
        t.start()
        t.join()
    finally:
        fast.set_threads(before)
    assert seen == [1]


def test_shape_contract_errors():
    rng = np.random.default_rng(0)
    bad = QWeight("fp4", rng.integers(0, 256, (4, 24), dtype=np.uint8), np.ones((4, 1), np.uint8), 4, 48)
    with pytest.raises(ValueError, match="multiples of 32"):
        fast.matvec(bad, np.ones(48, np.float32))
    w = weight("fp8", 4, 32, rng)
    with pytest.raises(ValueError, match="width 31"):
        fast.matmul(w, np.ones((2, 31), np.float32))
    with pytest.raises(ValueError, match="scale"):
        fast.matvec(QWeight("fp8", w.data, np.ones((2, 1), np.uint8), 4, 32), np.ones(32, np.float32))


def test_int8_view_and_warmup():
    rng = np.random.default_rng(2)
    w = weight("fp4", 16, 64, rng)
    as_i8 = QWeight("fp4", w.data.view(np.int8), w.scale, 16, 64)  # the checkpoint's I8 dtype
    x = rng.standard_normal(64).astype(np.float32)
    assert np.array_equal(fast.matvec(as_i8, x), fast.matvec(w, x))
    assert warm.warmup([f for f in warm.FORMS if f != "base"]) >= 0.0


def test_kernel_seconds_count_each_role():
    from dsv4stream import kernels

    rng = np.random.default_rng(4)
    w = weight("fp8", 128, 256, rng)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    before = kernels.kernel_seconds()
    kernels.matmul(w, x)
    kernels.matvec(replace(w, role="experts"), x[0])
    kernels.matmul_pair(replace(w, role="head"), w, x[:1])
    after = kernels.kernel_seconds()
    for role in ("trunk", "experts", "head"):
        assert after[role] > before.get(role, 0.0), role


def test_segment_size_cannot_change_bits():
    """Prefill segments are sized from --budget; a product over a long segment must give the
    same bits as over a short one."""
    rng = np.random.default_rng(31)
    w = weight("fp8", 256, 384, rng)
    x = rng.standard_normal((PREFILL_TOKENS + 5, 384)).astype(np.float32)
    y = fast.matmul(w, x)
    assert np.array_equal(y[-5:], fast.matmul(w, x[-5:]))
    assert np.array_equal(y[0], fast.matvec(w, x[0]))


def test_lane_sum_is_the_documented_pairwise_tree():
    """The vector-IR lane sum against the tree written out in numpy float32: level h adds lane k + h
    to lane k (h = 16, 8, 4, 2, 1). Values of mixed magnitude, so another order rounds differently."""

    @numba.njit
    def lane_sums(acc, n):
        out = np.empty(n, np.float32)
        for i in range(n):
            out[i] = jit._lane_sum(acc, 32 * i)
        return out

    rng = np.random.default_rng(11)
    n = 400
    acc = (rng.standard_normal(32 * n) * np.exp2(rng.integers(-20, 20, 32 * n))).astype(np.float32)
    want = acc.reshape(n, 32).copy()
    h = 16
    while h:
        want = want[:, :h] + want[:, h : 2 * h]
        h //= 2
    got = lane_sums(acc, n)
    assert np.array_equal(got.view(np.uint32), want[:, 0].view(np.uint32))
    # a different order (sequential) does differ on these inputs: the check can fail
    seq = np.zeros(n, np.float32)
    for k in range(32):
        seq += acc.reshape(n, 32)[:, k]
    assert not np.array_equal(seq.view(np.uint32), got.view(np.uint32))


@numba.njit
def _fp4_block_scalar(w, r, b, xe, xo, sr, acc):
    """The FP4 block arithmetic as the module docstring states it, one lane at a time."""
    a = (b % 2) * 16
    for k in range(16):
        i = b * 16 + k
        byte = w[r, i]
        acc[a + k] = jit._fma(jit._e2m1_hi(byte) * sr, xo[i], jit._fma(jit._e2m1_lo(byte) * sr, xe[i], acc[a + k]))


def test_fp4_block_decodes_have_the_bits_of_the_scalar_arithmetic():
    """The vector FP4 block by table lookup (AVX-512; elsewhere it falls back to the half decode)
    and by float16 bit patterns (what AVX2 and ARM machines run) against the scalar statement of
    the arithmetic: every byte value, relative scales from 2^-126 to 2^+20 and float32 ones that
    are not powers of two, flushed blocks, inputs of mixed magnitude and sign; identical lanes."""

    @numba.njit
    def lanes(w, rel, xe, xo):
        out = np.zeros((3, w.shape[0], 32), np.float32)
        for r in range(w.shape[0]):
            a_t, a_h, a_s = out[0, r], out[1, r], out[2, r]
            for b in range(w.shape[1] // 16):
                fp4._fp4_block_table(w, r, b, xe, xo, rel[r, b], a_t, (b % 2) * 16)
                fp4._fp4_block_half(w, r, b, xe, xo, rel[r, b], a_h, (b % 2) * 16)
                _fp4_block_scalar(w, r, b, xe, xo, rel[r, b], a_s)
        return out

    rng = np.random.default_rng(5)
    rows, nbytes = 64, 512
    w = rng.integers(0, 256, (rows, nbytes), dtype=np.uint8)
    w[0, :256] = np.arange(256, dtype=np.uint8)
    rel = np.exp2(rng.integers(-126, 21, (rows, nbytes // 16))).astype(np.float32)
    rel[rows // 2 :] *= rng.uniform(0.5, 1.0, rel[rows // 2 :].shape).astype(np.float32)
    rel[1, ::3] = 0.0  # flushed blocks
    xe = (rng.standard_normal(nbytes) * np.exp2(rng.integers(-30, 30, nbytes))).astype(np.float32)
    xo = (rng.standard_normal(nbytes) * np.exp2(rng.integers(-30, 30, nbytes))).astype(np.float32)
    table, half, scalar = lanes(w, rel, xe, xo)
    assert np.isfinite(scalar).all() and np.abs(scalar).max() > 0
    assert np.array_equal(table.view(np.uint32), scalar.view(np.uint32))
    assert np.array_equal(half.view(np.uint32), scalar.view(np.uint32))


def _kernel_module_imports() -> dict[str, set[str]]:
    """kernels/ submodule -> the kernels/ submodules it imports (at any depth, by `ast`); the
    package itself (`from . import QWeight`, the public API) is left out."""
    import ast
    from pathlib import Path

    here = Path(fast.__file__).parent
    names = {p.stem for p in here.glob("*.py")} - {"__init__"}
    out = {}
    for name in names:
        got = set()
        for node in ast.walk(ast.parse((here / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                got.update([node.module] if node.module else [a.name for a in node.names])
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                got.update(m.split(".")[2] for m in mods if m.startswith("dsv4stream.kernels."))
        out[name] = got & names
    return out


def test_the_kernel_modules_import_each_other_without_a_circle():
    """The plumbing (jit.py) imports no kernel module; everything else forms no circle (numba
    decorates a kernel at import: a circle would reach a half-initialised module)."""
    graph = _kernel_module_imports()
    assert graph["jit"] == set() and graph["tiles"] == {"jit"}
    assert {"fp4", "fp8", "plain", "tiles", "jit"} <= graph["fast"] and "jit" in graph["attn"]
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import circle: {' -> '.join((*path, name))}"
        if name not in done:
            for dep in sorted(graph[name]):
                visit(dep, (*path, name))
            done.add(name)

    for name in sorted(graph):
        visit(name, ())
