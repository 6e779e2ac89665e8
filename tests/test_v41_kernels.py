"""DeepSeek-V4.1's kernels: FP8 with 32x32 scale blocks (kernels/fp8.py's vector FP8 kernels,
shared with V4's 128x128 blocks) and the activation grid in numba (kernels/qdq.py).

- FP8 32x32 against `kernels/reference.py` (ml_dtypes decode, numpy float32 GEMM) to float32
  rounding, on ragged shapes: K odd, K not a multiple of 32 or 128, rows not a multiple of 32,
  token counts across the register blocks and the 128-token split; E8M0 and float32 scales.
- the same products, bit for bit, as the generic FP8 matvec (`_fp8_mv_serial`, a scalar decode)
  at bc = 32, once per token: the vector decode must not change a single result.
- `fp8_qdq_rows` against `model.v41.quant.fp8_qdq` (numpy + ml_dtypes, the definition the oracle
  fixtures check) bit for bit, on the oracle's inputs and on random magnitudes and ties.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dsv4stream import kernels
from dsv4stream.checkpoint import formats
from dsv4stream.kernels import QWeight, reference
from dsv4stream.model.v41.quant import act_qdq, fp8_qdq

fast = pytest.importorskip("dsv4stream.kernels.fast")
qdq = pytest.importorskip("dsv4stream.kernels.qdq")

QDQ_FIX = Path(__file__).parent / "fixtures" / "v41" / "quant" / "qdq.npz"


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def fp8w(rows: int, cols: int, rng, scale_kind: str = "e8m0", block: int = 32) -> QWeight:
    data = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    data[(data & 0x7F) == 0x7F] = 0x38  # no NaN codes
    sub = ((data & 0x78) == 0) & ((data & 0x07) != 0)  # subnormal codes in every 4th row only:
    sub[::4] = False  # both of `fp8._decoded32`'s paths
    data[sub] |= 0x08
    shape = (-(-rows // block), -(-cols // block))
    scale = rng.integers(116, 133, shape).astype(np.uint8)
    if scale_kind == "f32":
        scale = formats.e8m0_to_f32(scale) * rng.uniform(0.5, 1.0, shape).astype(np.float32)
    return QWeight("fp8", data, scale, rows, cols, block=(block, block))


def generic(w: QWeight, x: np.ndarray) -> np.ndarray:
    """The generic FP8 matvec (any block; its scalar loop decodes through float16) once per token,
    called directly: every product of the vector kernels, tile included, must give each token
    these bits."""
    out = np.empty((x.shape[0], w.rows), np.float32)
    data, scale = fast._u8(w.data), fast._scale(w)
    for t in range(x.shape[0]):
        fast._fp8_mv_serial(data, scale, *w.block, fast._aligned_copy(x[t : t + 1]), w.rows, out[t])
    return out


SHAPES = [(64, 256), (37, 96), (33, 1088), (70, 1000), (5, 31), (96, 2080), (41, 1281)]


@pytest.fixture(autouse=True)
def fast_backend():
    kernels.set_backend("fast")
    yield


@pytest.mark.parametrize("scale_kind", ["e8m0", "f32"])
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_fp8_32x32_against_the_reference_and_the_generic_kernels(rows, cols, scale_kind):
    rng = np.random.default_rng(rows * 7919 + cols)
    w = fp8w(rows, cols, rng, scale_kind)
    ref_w = reference.dequant(w).astype(np.float64)
    for t in (1, 2, 5, 48, 130):
        x = rng.standard_normal((t, cols)).astype(np.float32)
        got = kernels.matmul(w, x)
        ref = x.astype(np.float64) @ ref_w.T
        assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max(), (rows, cols, t)
        assert (bits(got) == bits(generic(w, x))).all(), f"differs from the generic kernel at {rows}x{cols}, T={t}"
        if t <= 5:
            mv = np.stack([kernels.matvec(w, x[i]) for i in range(t)])
            assert (bits(mv) == bits(got)).all()


def test_parallel_serial_pair_and_grouped_forms_have_the_same_bits(monkeypatch):
    rng = np.random.default_rng(5)
    w1, w3 = fp8w(160, 1000, rng), fp8w(160, 1000, rng)
    x = rng.standard_normal((1, 1000)).astype(np.float32)
    monkeypatch.setattr(fast, "PARALLEL_MIN_BYTES", 1 << 62)
    serial = kernels.matvec(w1, x[0]), kernels.matvec(w3, x[0])
    monkeypatch.setattr(fast, "PARALLEL_MIN_BYTES", 0)
    fast.set_threads(2)
    par = kernels.matvec(w1, x[0]), kernels.matvec(w3, x[0])
    y1, y3 = kernels.matmul_pair(w1, w3, x)
    for a, b, c in zip(serial, par, (y1[0], y3[0]), strict=True):
        assert (bits(a) == bits(b)).all() and (bits(a) == bits(c)).all()
    # the grouped output projection: 4 row blocks of one tensor, each group its own input
    whole = fp8w(128, 1000, rng)
    ws = [
        QWeight("fp8", whole.data[32 * i : 32 * i + 32], whole.scale[i : i + 1], 32, 1000, block=(32, 32))
        for i in range(4)
    ]
    xg = rng.standard_normal((1, 4, 1000)).astype(np.float32)
    got = kernels.matmul_grouped(ws, xg)
    want = np.concatenate([kernels.matmul(w, xg[:, i]) for i, w in enumerate(ws)], axis=1)
    assert (bits(got) == bits(want)).all()


def test_a_nan_scale_poisons_its_32_rows_only():
    rng = np.random.default_rng(9)
    w = fp8w(96, 200, rng)
    w.scale[1, 3] = 0xFF  # E8M0 NaN: block row 1 = rows 32..63
    x = rng.standard_normal((2, 200)).astype(np.float32)
    for y in (kernels.matmul(w, x), kernels.matvec(w, x[0])[None]):
        assert np.isnan(y[:, 32:64]).all()
        assert np.isfinite(y[:, :32]).all() and np.isfinite(y[:, 64:]).all()


def test_qdq_kernel_equals_the_numpy_definition_on_the_oracle_inputs():
    x = np.load(QDQ_FIX)["x"].astype(np.float32)
    got = qdq.fp8_qdq_rows(x)
    assert got is not None
    with np.errstate(over="ignore"):
        want = fp8_qdq(x, 32)
    assert (bits(got) == bits(want)).all()


def test_qdq_kernel_on_random_magnitudes_ties_and_signed_zeros():
    rng = np.random.default_rng(3)
    for scale in (1e-38, 1e-20, 1e-6, 1e-3, 1.0, 7.0, 1e4, 1e30):
        x = rng.standard_normal((3, 4, 96)) * scale * np.exp(rng.uniform(-12, 12, (3, 4, 96)))
        x = x.astype(np.float32)
        x[0, 0, :32] = 0.0
        x[0, 1, :32] = -0.0
        got = qdq.fp8_qdq_rows(x)
        with np.errstate(over="ignore", under="ignore"):
            want = fp8_qdq(x, 32)
        assert got.shape == x.shape and (bits(got) == bits(want)).all(), scale
    # exact ties of the E4M3 grid at every exponent (block amax 448 * 2^k keeps the scale 2^k)
    grid = np.arange(-448, 449, dtype=np.float32)
    ties = np.concatenate([grid[:-1] + np.float32(0.5), grid / np.float32(64) + np.float32(2.0**-10)])
    x = np.resize(ties, (ties.size // 31 + 1) * 32).reshape(-1, 32)
    x[:, 0] = 448.0
    assert (bits(qdq.fp8_qdq_rows(x)) == bits(fp8_qdq(x, 32))).all()


def test_non_finite_inputs_fall_back_to_the_definition():
    x = np.ones((2, 64), np.float32)
    x[1, 40] = np.nan
    x[0, 3] = np.inf
    assert qdq.fp8_qdq_rows(x) is None
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        assert (bits(act_qdq(x)) == bits(fp8_qdq(x, 32))).all()
    with pytest.raises(ValueError, match="multiple"):
        qdq.fp8_qdq_rows(np.ones((1, 33), np.float32))


def test_ties_round_to_even_in_both_directions():
    # amax 448 keeps the scale at 1 or 2; 1 + 2^-4 and 1 + 3 * 2^-4 are ties of the E4M3 grid at
    # that scale: the even neighbours are 1.0 (down) and 1.25 (up); truncation would give 1.125
    for s_amax in (np.float32(448.0), np.float32(224.0)):
        x = np.zeros((1, 32), np.float32)
        x[0, 0] = s_amax
        x[0, 1:3] = (1.0 + 2.0**-4, 1.0 + 3 * 2.0**-4)
        got, want = qdq.fp8_qdq_rows(x), fp8_qdq(x, 32)
        assert (bits(got) == bits(want)).all()
        assert got[0, 1] == 1.0 and got[0, 2] == 1.25


def numpy_sinkhorn(comb: np.ndarray, iters: int, eps: np.float32) -> np.ndarray:
    """`model.mhc.split_mixes`'s numpy loop, as it stood before the numba form."""
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return comb


def test_sinkhorn_kernel_has_numpys_bits():
    from dsv4stream.kernels import sinkhorn
    from dsv4stream.model.ops import softmax

    rng = np.random.default_rng(11)
    for hc in (1, 2, 3, 4, 5, 7):
        for t in (1, 3, 40):
            for iters in (1, 2, 20):
                for eps in (np.float32(1e-6), np.float32(1e-2)):
                    logits = (rng.standard_normal((t, hc, hc)) * rng.uniform(0.1, 30)).astype(np.float32)
                    comb = softmax(logits, axis=-1) + eps
                    want = numpy_sinkhorn(comb, iters, eps)
                    got = sinkhorn.sinkhorn(comb.copy(), iters, eps)
                    assert (bits(got) == bits(want)).all(), (hc, t, iters, eps)
    with pytest.raises(ValueError, match="hc < 8"):
        sinkhorn.sinkhorn(np.ones((1, 8, 8), np.float32), 2, np.float32(1e-6))


def test_a_pairwise_sum_would_differ_from_numpys_order():
    # guards the premise of the kernel: numpy's order (one by one) is not the pairwise one
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((20000, 4)) * np.exp(rng.uniform(-8, 8, (20000, 4)))).astype(np.float32)
    seq = ((x[:, 0] + x[:, 1]) + x[:, 2]) + x[:, 3]
    pair = (x[:, 0] + x[:, 1]) + (x[:, 2] + x[:, 3])
    assert (bits(x.sum(axis=-1)) == bits(seq)).all()
    assert not (bits(x.sum(axis=-1)) == bits(pair)).all()
