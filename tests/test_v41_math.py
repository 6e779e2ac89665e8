"""DeepSeek-V4.1's pure math (model/v41/*.py) against direct statements of it.

Each test writes the rule out again in the plainest numpy (loops, float64 where it helps) and
compares; the chunked forms are checked against the whole-sequence form they must equal.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv4stream.kernels import QWeight, matmul
from dsv4stream.model.mhc import HcWeights, hc_pre
from dsv4stream.model.moe import ExpertWeights
from dsv4stream.model.ops import silu
from dsv4stream.model.rope import Rope, plain_inv_freq
from dsv4stream.model.v41.block import HcParams, hc_mixes, identity_pre
from dsv4stream.model.v41.engram import EngramWeights, engram
from dsv4stream.model.v41.indexer import candidate_blocks, restrict_to, top_rows
from dsv4stream.model.v41.kv import SourceState, V41CompressorWeights, append_rows, latents
from dsv4stream.model.v41.moe import V41MoeParams, V41MoeWeights, moe, route
from dsv4stream.model.v41.quant import fp8_qdq

F32 = np.float32


def f32w(a: np.ndarray) -> QWeight:
    a = np.ascontiguousarray(a, dtype=F32)
    return QWeight("f32", a, None, a.shape[0], a.shape[1])


def rms(x, w=None, eps=1e-20):
    y = x / np.sqrt(np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# ---- compressor ----------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [1, 2])
def test_compressor_latents_match_the_rule_in_any_chunking(ratio, rng):
    d, hd, t = 64, 32, 11
    w = V41CompressorWeights(
        wkv=f32w(rng.standard_normal((hd, d))),
        wgate=f32w(rng.standard_normal((hd, d))) if ratio == 2 else None,
        norm=rng.uniform(0.5, 1.5, hd).astype(F32),
        ratio=ratio,
    )
    x = rng.standard_normal((t, d)).astype(F32)
    kv = x.astype(np.float64) @ w.wkv.data.T.astype(np.float64)
    if ratio == 1:
        want = rms(kv, w.norm)
    else:
        g = x.astype(np.float64) @ w.wgate.data.T.astype(np.float64)
        n = t // 2
        e = np.exp(g[: 2 * n].reshape(n, 2, hd) - g[: 2 * n].reshape(n, 2, hd).max(axis=1, keepdims=True))
        want = rms(np.sum(e / e.sum(axis=1, keepdims=True) * kv[: 2 * n].reshape(n, 2, hd), axis=1), w.norm)
    for cuts in ([t], [1] * t, [3, 5, 3], [2, 2, 7]):
        st, got, a = SourceState(hd, 16, ratio, False), [], 0
        for c in cuts:
            got.append(latents(st, x[a : a + c], w, 1e-20))
            a += c
        assert np.allclose(np.concatenate(got), want, rtol=1e-5, atol=1e-5), cuts


def test_rows_and_keys_are_rotated_at_the_first_position_of_their_group_then_put_on_their_grids(rng):
    from dsv4stream.model.v41.kv import IndexKeyWeights
    from dsv4stream.model.v41.quant import fp4_qdq_e4m3, fp4_qdq_e8m0

    hd, ihd, ratio = 32, 32, 2
    rope = Rope(plain_inv_freq(10000.0, 8))
    keys = IndexKeyWeights(wk=f32w(rng.standard_normal((ihd, hd))), k_norm=np.ones(ihd, F32))
    st = SourceState(hd, ihd, ratio, True)
    lat = rng.standard_normal((3, hd)).astype(F32)
    append_rows(st, lat[:1], ratio, rope, keys, 1e-20, quantise=True)
    append_rows(st, lat[1:], ratio, rope, keys, 1e-20, quantise=True)
    cos, sin = rope.cos_sin(np.array([0, 2, 4]))

    def rot(v):  # interleaved pairs of the last 8 channels
        v = v.astype(np.float64).copy()
        e, o = v[:, -8::2].copy(), v[:, -7::2].copy()
        v[:, -8::2], v[:, -7::2] = e * cos - o * sin, o * cos + e * sin
        return v.astype(F32)

    assert np.allclose(st.rows.rows, fp4_qdq_e4m3(rot(lat), 16), atol=1e-6)
    k = rms(lat.astype(np.float64) @ keys.wk.data.T.astype(np.float64)).astype(F32)
    assert np.allclose(st.keys.rows, fp4_qdq_e8m0(rot(k), 32), atol=1e-6)


# ---- indexer ---------------------------------------------------------------------------------


def test_candidate_blocks_keep_the_best_blocks_and_always_the_newest(rng):
    t, n, block, keep = 6, 37, 4, 3
    scores = rng.standard_normal((t, n)).astype(F32)
    positions = np.array([5, 20, 36, 50, 73, 73])  # ratio 2: visible rows 3, 10, 18, 25, 37, 37
    ratio = 2
    visible = (positions + 1) // ratio
    scores = np.where(np.arange(n)[None] < visible[:, None], scores, -np.inf).astype(F32)
    got = candidate_blocks(scores, positions, ratio, block, keep)
    for i in range(t):
        nb = -(-n // block)
        best = [scores[i, b * block : (b + 1) * block].max() for b in range(nb)]
        newest = (visible[i] - 1) // block
        order = sorted(range(nb), key=lambda b: (-(np.inf if b == newest else best[b]), b))
        want = {b for b in order[:keep] if b == newest or best[b] > -np.inf}
        assert set(np.flatnonzero(got[i])) == want, i


def test_level_two_and_top_rows_never_pick_what_a_query_cannot_use(rng):
    t, n = 4, 16
    scores = rng.standard_normal((t, n)).astype(F32)
    blocks = np.zeros((t, 4), bool)
    blocks[:, 1] = True  # rows 4..7 only
    s = restrict_to(scores, blocks, 4)
    got = top_rows(s, positions_end=16, ratio=1, topk=6)
    assert got.shape == (t, 6)
    for i in range(t):
        real = got[i][got[i] >= 0]
        assert sorted(real.tolist()) == real.tolist() and set(real.tolist()) == {4, 5, 6, 7}
        assert (got[i][4:] == -1).all()
    assert top_rows(scores, positions_end=1, ratio=2, topk=6).shape == (t, 0)


# ---- mHC, Engram, MoE --------------------------------------------------------------------------


def test_hc_mixes_split_as_v4_does_and_the_first_pre_is_stream_zero(rng):
    hc, d, t = 4, 32, 5
    w = HcWeights(f32w(rng.standard_normal((24, hc * d)) * 0.1), rng.standard_normal(24).astype(F32), np.ones(3, F32))
    x = rng.standard_normal((t, hc, d)).astype(F32)
    pre, post, comb = hc_mixes(x, w, HcParams(20, 1e-6, 1e-20))
    collapsed, post4, comb4 = hc_pre(x, w, 20, 1e-6, 1e-20)  # V4 norms first, V4.1 after the product
    assert np.allclose(post, post4, atol=1e-6) and np.allclose(comb, comb4, atol=1e-6)
    assert np.allclose(np.einsum("th,thd->td", pre, x), collapsed, atol=1e-5)
    assert np.array_equal(identity_pre(3, hc), np.tile([1, 0, 0, 0], (3, 1)).astype(F32))


@pytest.mark.parametrize("quantise", [False, True])
def test_engram_gate_follows_the_rule_per_stream_copy(quantise, rng):
    t, hc, d, cols, hdim = 3, 4, 32, 6, 32
    wkv = rng.standard_normal(((hc + 1) * d, cols * hdim)).astype(F32) * 0.05
    w = EngramWeights(wkv=f32w(wkv), qk=rng.standard_normal((hc, d)).astype(F32))
    x = rng.standard_normal((t, hc, d)).astype(F32)
    rows = rng.standard_normal((t, cols, hdim)).astype(F32)
    mask = np.array([True, False, True])
    got = engram(x, rows, w, 1e-20, quantise, mask)
    e = rows.reshape(t, -1)
    kv = (fp8_qdq(e) if quantise else e).astype(np.float64) @ wkv.T.astype(np.float64)
    for i in range(t):
        for c in range(hc):
            key, value, h = kv[i, c * d : (c + 1) * d], kv[i, hc * d :], x[i, c].astype(np.float64)
            dot = np.sum(h * w.qk[c] * key) / np.sqrt(np.mean(h * h)) / np.sqrt(np.mean(key * key)) / np.sqrt(d)
            gate = 1 / (1 + np.exp(-np.copysign(np.sqrt(max(abs(dot), 1e-6)), dot))) if mask[i] else 0.0
            assert np.allclose(got[i, c], h + gate * value, rtol=1e-4, atol=1e-5), (i, c)


def _expert(rng, d, m):
    return ExpertWeights(*(f32w(rng.standard_normal(s) * 0.2) for s in ((m, d), (d, m), (m, d))))


@pytest.mark.parametrize("quantise", [False, True])
def test_moe_weights_each_expert_before_its_down_projection(quantise, rng):
    d, m, e, k, t = 32, 64, 8, 3, 5
    experts = {i: _expert(rng, d, m) for i in range(e)}
    w = V41MoeWeights(
        gate=f32w(rng.standard_normal((e, d))),
        bias=rng.standard_normal(e).astype(F32),
        bias_vl=rng.standard_normal(e).astype(F32),
        shared=_expert(rng, d, m),
    )
    p = V41MoeParams(k, 1.5, 10.0, True, quantise)
    x = rng.standard_normal((t, d)).astype(F32)
    image = np.array([False, True, False, False, True])
    got = moe(x, w, lambda ids: ((int(i), experts[int(i)]) for i in ids[::-1]), p, image=image)
    q = (lambda v: fp8_qdq(v)) if quantise else (lambda v: v)

    def ffn(ew, v, weight):  # the kernels' own products and silu: only the order of steps is under test
        g = np.minimum(matmul(ew.w1, q(v)), F32(10.0))
        u = np.clip(matmul(ew.w3, q(v)), F32(-10.0), F32(10.0))
        return matmul(ew.w2, q(silu(g) * u * F32(weight)))

    experts_, weights_ = route(x, w, p, image)
    for i in range(t):
        s = np.sqrt(np.logaddexp(0, x[i].astype(np.float64) @ w.gate.data.T.astype(np.float64)))
        b = w.bias_vl if image[i] else w.bias
        pick = np.argsort(-(s + b), kind="stable")[:k]
        assert sorted(experts_[i].tolist()) == sorted(pick.tolist())
        wt = s[np.sort(pick)] / s[pick].sum() * 1.5
        assert np.allclose(weights_[i], wt, rtol=1e-5)
        want = sum(ffn(experts[int(ei)], x[i : i + 1], wt[j]) for j, ei in enumerate(np.sort(pick)))
        want = want + ffn(w.shared, x[i : i + 1], 1.0)
        assert np.allclose(got[i], want[0], rtol=1e-6, atol=1e-6), i
