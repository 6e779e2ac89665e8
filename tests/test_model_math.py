"""The forward pass's building blocks on small arrays, against hand-written definitions."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest

from dsv4stream.checkpoint import formats
from dsv4stream.kernels import QWeight, attend, dense, matmul
from dsv4stream.model.cache import WindowCache
from dsv4stream.model.mhc import HcWeights, hc_post, hc_pre
from dsv4stream.model.moe import ExpertWeights, MoeWeights, route, routed_experts, swiglu
from dsv4stream.model.ops import rms_norm, silu, topk_lowest_index
from dsv4stream.model.rope import Rope, apply_rope, plain_inv_freq, yarn_inv_freq
from dsv4stream.model.v4.compressor import CompressorState, CompressorWeights, compress
from dsv4stream.weights.loading import split_rows

RNG = np.random.default_rng(0)


def f32w(a: np.ndarray) -> QWeight:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return QWeight("f32", a, None, a.shape[0], a.shape[1])


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# ---- rope ----------------------------------------------------------------------------
def test_rope_rotates_trailing_interleaved_pairs() -> None:
    rope = Rope(plain_inv_freq(10000.0, 8))
    x = randn(3, 2, 12)  # (T, H, d): 4 untouched channels, then 4 pairs
    pos = np.array([0, 5, 77])
    cos, sin = rope.cos_sin(pos)
    y = apply_rope(x, cos, sin)
    np.testing.assert_array_equal(y[..., :4], x[..., :4])
    z = x[..., 4::2] + 1j * x[..., 5::2]
    ang = pos[:, None, None] * rope.inv_freq.astype(np.float64)[None, None, :]
    want = z * np.exp(1j * ang)
    np.testing.assert_allclose(y[..., 4::2], want.real, atol=2e-5)
    np.testing.assert_allclose(y[..., 5::2], want.imag, atol=2e-5)
    np.testing.assert_allclose(apply_rope(y, cos, sin, inverse=True), x, atol=1e-5)


def test_rope_scores_depend_on_distance_only() -> None:
    rope = Rope(plain_inv_freq(160000.0, 16))
    q, k = randn(1, 16), randn(1, 16)

    def score(pq: int, pk: int) -> float:
        cq, sq = rope.cos_sin(np.array([pq]))
        ck, sk = rope.cos_sin(np.array([pk]))
        return float(apply_rope(q, cq, sq)[0] @ apply_rope(k, ck, sk)[0])

    assert score(9, 4) == pytest.approx(score(105, 100), rel=1e-4)


def test_yarn_keeps_fast_and_interpolates_slow_frequencies() -> None:
    theta, rd, factor, orig = 160000.0, 64, 16.0, 65536
    y = yarn_inv_freq(theta, rd, factor, orig, 32.0, 1.0)
    p = plain_inv_freq(theta, rd)
    low = math.floor(rd * math.log(orig / (32 * 2 * math.pi)) / (2 * math.log(theta)))
    high = math.ceil(rd * math.log(orig / (1 * 2 * math.pi)) / (2 * math.log(theta)))
    np.testing.assert_allclose(y[:low], p[:low], rtol=1e-6)
    np.testing.assert_allclose(y[high:], p[high:] / factor, rtol=1e-6)
    assert np.all((y[low:high] <= p[low:high]) & (y[low:high] >= p[low:high] / factor))


# ---- mHC -----------------------------------------------------------------------------
def _hc_weights(hc: int, d: int) -> HcWeights:
    m = (2 + hc) * hc
    return HcWeights(f32w(randn(m, hc * d) * 0.3), randn(m) * 0.5, np.array([0.7, 1.1, 0.9], np.float32))


def test_hc_pre_shapes_ranges_and_doubly_stochastic_comb() -> None:
    hc, d = 4, 16
    x = randn(5, hc, d)
    h, post, comb = hc_pre(x, _hc_weights(hc, d), 20, 1e-6, 1e-6)
    assert h.shape == (5, d) and post.shape == (5, hc) and comb.shape == (5, hc, hc)
    assert np.all((post > 0) & (post < 2))
    np.testing.assert_allclose(comb.sum(axis=-2), 1.0, atol=1e-4)
    np.testing.assert_allclose(comb.sum(axis=-1), 1.0, atol=1e-3)


def test_hc_pre_norms_over_the_flattened_streams() -> None:
    """Scaling the streams does not change pre/post/comb (RMS over all hc*D values)."""
    hc, d = 3, 8
    w, x = _hc_weights(hc, d), randn(2, hc, d)
    h1, p1, c1 = hc_pre(x, w, 5, 1e-6, 1e-6)
    h2, p2, c2 = hc_pre(3 * x, w, 5, 1e-6, 1e-6)
    np.testing.assert_allclose(p1, p2, rtol=1e-5)
    np.testing.assert_allclose(c1, c2, rtol=1e-5)
    np.testing.assert_allclose(3 * h1, h2, rtol=1e-5, atol=1e-5)


def test_hc_post_mixes_streams_by_comb_transposed() -> None:
    hc, d = 3, 4
    x, y, post, comb = randn(2, hc, d), randn(2, d), randn(2, hc), randn(2, hc, hc)
    out = hc_post(x, y, post, comb)
    for t in range(2):
        for k in range(hc):
            want = post[t, k] * y[t] + sum(comb[t, j, k] * x[t, j] for j in range(hc))
            np.testing.assert_allclose(out[t, k], want, rtol=1e-5, atol=1e-6)


# ---- compressor ------------------------------------------------------------------------
def _comp_weights(ratio: int, d: int, dim: int, overlap: bool) -> CompressorWeights:
    width = 2 * d if overlap else d
    return CompressorWeights(
        f32w(randn(width, dim) * 0.3), f32w(randn(width, dim) * 0.3), randn(ratio, width), 1 + 0.1 * randn(d)
    )


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False), (4, False)])
def test_compressor_any_split_gives_the_same_rows(ratio: int, overlap: bool) -> None:
    d, dim, n = 8, 12, 45
    w = _comp_weights(ratio, d, dim, overlap)
    rope = Rope(plain_inv_freq(160000.0, 4))
    x = randn(n, dim)
    whole = CompressorState(d, overlap, ratio)
    compress(whole, x, w, rope, 1e-6)
    assert whole.rows.shape == (n // ratio, d)
    pieces = CompressorState(d, overlap, ratio)
    cuts = [0, 1, 2, 7, 8, 9, 30, n]
    for a, b in itertools.pairwise(cuts):
        compress(pieces, x[a:b], w, rope, 1e-6)
    np.testing.assert_allclose(pieces.rows, whole.rows, rtol=1e-5, atol=1e-6)


def test_compressor_row_is_gated_softmax_pool_roped_at_window_start() -> None:
    ratio, d, dim = 4, 6, 5
    w = _comp_weights(ratio, d, dim, overlap=False)
    rope = Rope(plain_inv_freq(10000.0, 2))
    x = randn(8, dim)
    st = CompressorState(d, overlap=False, ratio=ratio)
    rows = compress(st, x, w, rope, 1e-6)
    kv, g = dense(w.wkv) @ x[4:].T, (dense(w.wgate) @ x[4:].T).T + w.ape  # window 1
    p = np.exp(g - g.max(0)) / np.exp(g - g.max(0)).sum(0)
    pooled = rms_norm((p * kv.T).sum(0), w.norm, 1e-6)
    cos, sin = rope.cos_sin(np.array([4]))
    np.testing.assert_allclose(rows[1], apply_rope(pooled[None], cos, sin)[0], rtol=1e-5, atol=1e-6)


def test_overlap_first_window_has_no_previous_half() -> None:
    """Row 0 ignores the Ca channels of window 0; row 1 uses them."""
    ratio, d, dim = 4, 4, 6
    w = _comp_weights(ratio, d, dim, overlap=True)
    wkv = dense(w.wkv).copy()
    rope = Rope(plain_inv_freq(10000.0, 2))
    x = randn(8, dim)
    base = CompressorState(d, True, ratio)
    compress(base, x, w, rope, 1e-6)
    wkv[:d] *= 2.0  # change Ca only
    w2 = CompressorWeights(f32w(wkv), w.wgate, w.ape, w.norm)
    other = CompressorState(d, True, ratio)
    compress(other, x, w2, rope, 1e-6)
    np.testing.assert_allclose(other.rows[0], base.rows[0], rtol=1e-6)
    assert not np.allclose(other.rows[1], base.rows[1])


# ---- attention -----------------------------------------------------------------------
def test_sink_joins_the_denominator_only() -> None:
    q, k = randn(1, 2, 8), randn(1, 8)
    sink = np.array([0.5, -1.0], np.float32)
    out = attend(q, k, np.ones((1, 1), bool), None, None, None, sink)
    s = (q[0] @ k[0]) / math.sqrt(8)
    wgt = np.exp(s) / (np.exp(s) + np.exp(sink))
    np.testing.assert_allclose(out[0], wgt[:, None] * k[0][None], rtol=1e-5)


def test_attend_gathered_rows_equal_dense_mask() -> None:
    q, keys, comp = randn(3, 2, 8), randn(5, 8), randn(6, 8)
    key_mask = RNG.random((3, 5)) < 0.7
    key_mask[:, 0] = True
    idx = np.array([[0, 3, -1], [5, 1, 2], [-1, -1, -1]])
    mask = np.zeros((3, 6), bool)
    for t, row in enumerate(idx):
        mask[t, row[row >= 0]] = True
    sink = randn(2)
    a = attend(q, keys, key_mask, comp, None, idx, sink)
    b = attend(q, keys, key_mask, comp, mask, None, sink)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_window_cache_keeps_the_last_positions() -> None:
    wc = WindowCache(4, 2)
    for a, b in ((0, 3), (3, 4), (4, 10)):
        pos = np.arange(a, b)
        wc.push(np.repeat(pos[:, None].astype(np.float32), 2, axis=1), pos)
    keys, kpos = wc.with_new(np.zeros((1, 2), np.float32), np.array([10]))
    assert sorted(kpos[:-1].tolist()) == [6, 7, 8, 9]
    np.testing.assert_array_equal(keys[:-1, 0], kpos[:-1])


# ---- routing and experts -------------------------------------------------------------
def test_topk_ties_go_to_the_lower_index() -> None:
    s = np.array([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    np.testing.assert_array_equal(topk_lowest_index(s, 2), [[1, 2], [0, 1]])
    np.testing.assert_array_equal(topk_lowest_index(s, 4), [[1, 2, 3, 4], [0, 1, 2, 3]])


def _moe(e: int, d: int, bias=None, tid2eid=None) -> MoeWeights:
    sh = ExpertWeights(f32w(randn(4, d)), f32w(randn(d, 4)), f32w(randn(4, d)))
    return MoeWeights(f32w(randn(e, d)), bias, tid2eid, sh)


def test_route_bias_selects_but_does_not_weight() -> None:
    e, d, k = 6, 8, 2
    x = randn(4, d)
    bias = np.zeros(e, np.float32)
    bias[[1, 4]] = 100.0  # forces experts 1 and 4
    w = _moe(e, d, bias=bias)
    experts, weights = route(x, np.zeros(4, np.int64), w, k, 1.5)
    np.testing.assert_array_equal(experts, [[1, 4]] * 4)
    scores = np.sqrt(np.log1p(np.exp(x @ dense(w.gate).T)))
    want = scores[:, [1, 4]] / scores[:, [1, 4]].sum(1, keepdims=True) * 1.5
    np.testing.assert_allclose(weights, want, rtol=1e-5)


def test_hash_route_takes_experts_from_the_token() -> None:
    e, d = 6, 8
    tid2eid = np.array([[0, 5], [3, 2], [4, 1]], np.int64)
    w = _moe(e, d, tid2eid=tid2eid)
    experts, weights = route(randn(3, d), np.array([2, 0, 1]), w, 2, 1.0)
    np.testing.assert_array_equal(experts, tid2eid[[2, 0, 1]])
    np.testing.assert_allclose(weights.sum(1), 1.0, rtol=1e-6)


def test_swiglu_clamp_is_asymmetric() -> None:
    eye = f32w(np.eye(3, dtype=np.float32))
    x = np.array([[-20.0, 20.0, 0.5]], np.float32)
    y = swiglu(x, ExpertWeights(eye, eye, eye), 7.0)
    gate = np.minimum(x, 7.0)
    up = np.clip(x, -7.0, 7.0)
    np.testing.assert_allclose(y, gate / (1 + np.exp(-gate)) * up, rtol=1e-6)


def test_silu_matches_float64_over_the_whole_range_without_warnings() -> None:
    edges = [-1e30, -3e38, 3e38, 0.0, -0.0, 1e-30, -5e-39]
    x = np.concatenate([np.linspace(-120, 120, 20001), edges]).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e^-x overflows below about -88: no RuntimeWarning may escape
        y = silu(x.reshape(2, -1)).reshape(-1)
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):
        ref = x64 / (1.0 + np.exp(-x64))
    assert y.dtype == np.float32 and np.isfinite(y).all()
    np.testing.assert_allclose(y, ref, rtol=3e-7, atol=1e-35)  # below -88 the result is -0, not ~-1e-37
    assert np.isnan(silu(np.array([np.nan], np.float32))).all()


def test_routed_experts_run_each_expert_once_for_its_tokens() -> None:
    d = 8
    ex = {i: ExpertWeights(f32w(randn(4, d)), f32w(randn(d, 4)), f32w(randn(4, d))) for i in range(5)}
    x = randn(6, d)
    experts = RNG.integers(0, 5, (6, 2))
    weights = RNG.random((6, 2)).astype(np.float32)
    calls = []

    def each(ids):  # hands the experts in reverse: the sum's order must not follow it
        calls.extend(int(e) for e in ids)
        for e in reversed(ids.tolist()):
            yield e, ex[e]

    out = routed_experts(x, experts, weights, each, 10.0)
    assert calls == sorted(set(experts.ravel().tolist()))
    for t in range(6):
        want = sum(weights[t, j] * swiglu(x[t : t + 1], ex[experts[t, j]], 10.0)[0] for j in range(2))
        np.testing.assert_allclose(out[t], want, rtol=1e-5, atol=1e-6)


# ---- weights ---------------------------------------------------------------------------
def test_split_rows_fp8_aligned_and_unaligned() -> None:
    for rows, parts in ((256, 2), (64, 2)):
        data, scale = formats.quantize_fp8(randn(rows, 96))
        w = QWeight("fp8", data, scale, rows, 96)
        x = randn(3, 96)
        full = matmul(w, x)
        groups = split_rows(w, parts)
        if rows % (128 * parts) == 0:
            assert all(g.kind == "fp8" for g in groups)
        got = np.concatenate([matmul(g, x) for g in groups], axis=1)
        np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-5)


def test_rms_norm_of_one_row_equals_that_row_of_a_batch_bit_for_bit():
    """rms_norm takes a scalar path for a single row (a decode step): its bits must be those of
    the same row normed among others (a prefill), with and without a weight, 1-D and 2-D."""
    from dsv4stream.model.ops import rms_norm

    rng = np.random.default_rng(3)
    for n in (64, 1024, 4096, 16384):
        x = (rng.standard_normal((5, n)) * rng.uniform(1e-3, 1e3, (5, 1))).astype(np.float32)
        w = rng.standard_normal(n).astype(np.float32)
        for weight in (None, w):
            batch = rms_norm(x, weight, 1e-6)
            for i in range(5):
                for one in (rms_norm(x[i : i + 1], weight, 1e-6)[0], rms_norm(x[i], weight, 1e-6)):
                    assert one.dtype == np.float32
                    np.testing.assert_array_equal(one.view(np.uint32), batch[i].view(np.uint32))
