"""A decode layer's routed experts with the SwiGLU inside the drivers (`experts_q8.swiglu_sum`).

Independent of the fused drivers: `pair_products`, numpy's SwiGLU (`model.moe._glu`, the routing
weight multiplied into h for V4.1's order) and `down_sum`, the two-call path every test in
test_experts_q8.py checks against each expert's own products. The fused call must give its bits
exactly: V4's and V4.1's weighting orders, E8M0 and float32 scales, one token with k distinct
experts (a decode step's `Routing` shortcut), several tokens with one listing an expert twice,
gates above the limit and far below zero (e^-gate overflows), a NaN in x, at 1 and 2 threads;
every element of its buffers written (they start as NaN: a row the work split dropped would
show); `Layer.whole` takes it when it knows the limit. The Haswell child in test_experts_q8.py
runs `check_swiglu_sum` for AVX2.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from test_experts_q8 import HOST, LIMIT, D, expert, glu, needs_fast, routing

from dsv4stream.kernels import experts_q8

PARTS = experts_q8._parts


def two_calls(variant: str, x, rt, w1s, w2s, w3s, pre: bool) -> np.ndarray:
    gate, up = experts_q8.pair_products(variant, x, rt, w1s, w3s)
    h = glu(gate, up)
    if pre:
        h *= rt.wp[:, None]
    return experts_q8.down_sum(variant, h, rt, w2s, np.ones_like(rt.wp) if pre else None)


def cases(rng, f32_scale: bool):
    """(x, experts, weights, table): 7 tokens (token 1 lists expert 5 twice, a NaN in token 2,
    gates spread wide), and one token with 3 distinct experts."""
    table = {e: expert(rng, f32_scale) for e in range(6)}
    x = (rng.standard_t(3, (7, D)) * 60).astype(np.float32)  # gates beyond +-LIMIT and below -88
    x[2, 7] = np.nan
    experts, weights = routing(rng, 7)
    yield x, experts, weights, table
    one = np.array([[4, 0, 3]], np.int64)
    yield x[3:4], one, weights[3:4], table


def check_swiglu_sum(variant: str, threads=(1,)) -> None:
    rng = np.random.default_rng(21)
    before = numba.get_num_threads()
    try:
        for f32_scale in (False, True):
            for x, experts, weights, table in cases(rng, f32_scale):
                rt = experts_q8.Routing(experts, weights)
                es = [table[int(e)] for e in rt.ids]
                w1s, w2s, w3s = ([PARTS(getattr(e, m)) for e in es] for m in ("w1", "w2", "w3"))
                for pre in (False, True):
                    want = two_calls(variant, x, rt, w1s, w2s, w3s, pre)
                    assert np.isfinite(want).any()
                    for n in threads:
                        numba.set_num_threads(n)
                        got = experts_q8.swiglu_sum(variant, x, rt, w1s, w3s, w2s, LIMIT, pre)
                        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
                    after = two_calls(variant, x, rt, w1s, w2s, w3s, not pre)
                    assert not np.array_equal(after, want)  # the order of the weighting shows
    finally:
        numba.set_num_threads(before)


@needs_fast
@pytest.mark.parametrize("variant", ["host", "avx2"])
def test_fused_layer_call_has_the_two_call_bits(variant):
    threads = (1, 2) if numba.config.NUMBA_NUM_THREADS >= 2 else (1,)
    check_swiglu_sum(HOST if variant == "host" else "avx2", threads)


@needs_fast
def test_fused_call_writes_every_element(monkeypatch):
    """Buffers from NaN: a (pair, row) the work split skipped would stay NaN (or hold a stale
    value np.empty happened to give), so the result would differ from the two-call path's."""
    monkeypatch.setattr(experts_q8, "_empty", lambda shape, dtype: np.full(shape, np.nan, dtype))
    rng = np.random.default_rng(22)
    table = {e: expert(rng) for e in range(6)}
    x = rng.standard_normal((5, D)).astype(np.float32)
    experts, weights = routing(rng, 5)
    rt = experts_q8.Routing(experts, weights)
    es = [table[int(e)] for e in rt.ids]
    w1s, w2s, w3s = ([PARTS(getattr(e, m)) for e in es] for m in ("w1", "w2", "w3"))
    want = two_calls(HOST, x, rt, w1s, w2s, w3s, False)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(experts_q8.swiglu_sum(HOST, x, rt, w1s, w3s, w2s, LIMIT), want)


def general_routing(experts, weights) -> experts_q8.Routing:
    """`Routing` of experts as two tokens, the second dropped: the general path's fields."""
    two = experts_q8.Routing(np.concatenate([experts, experts + 1000]), np.concatenate([weights, weights]))
    k = experts.shape[1]
    rt = experts_q8.Routing.__new__(experts_q8.Routing)
    rt.ids, rt.lo, rt.hi = two.ids[:k], two.lo[:k], two.hi[:k]
    rt.tok, rt.wp, rt.tp = two.tok[:k], two.wp[:k], two.tp[:1]
    return rt


def test_one_token_routing_shortcut_equals_the_general_path():
    rng = np.random.default_rng(23)
    for k in (1, 2, 6, 8):
        experts = rng.choice(256, (1, k), replace=False).astype(np.int64)
        weights = rng.random((1, k), dtype=np.float32)
        got, want = experts_q8.Routing(experts, weights), general_routing(experts, weights)
        for f in ("ids", "lo", "hi", "tok", "wp", "tp"):
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f))
            assert getattr(got, f).dtype == getattr(want, f).dtype, f
    twice = experts_q8.Routing(np.array([[3, 1, 3]]), np.ones((1, 3), np.float32))  # not distinct: general
    np.testing.assert_array_equal(twice.lo, [0, 1])
    np.testing.assert_array_equal(twice.hi, [1, 3])


@needs_fast
def test_a_layer_that_knows_the_limit_runs_the_fused_call(monkeypatch):
    rng = np.random.default_rng(24)
    table = {e: expert(rng) for e in range(6)}
    x = rng.standard_normal((3, D)).astype(np.float32)
    experts, weights = routing(rng, 3)
    group = [(int(e), table[int(e)]) for e in np.unique(experts)]
    calls = []
    real = experts_q8.swiglu_sum
    monkeypatch.setattr(experts_q8, "swiglu_sum", lambda *a, **k: calls.append(1) or real(*a, **k))
    for pre in (False, True):
        plain = experts_q8.Layer(HOST, x, experts, weights, glu, pre_weight=pre).whole(group)
        assert not calls
        fused = experts_q8.Layer(HOST, x, experts, weights, glu, pre_weight=pre, limit=LIMIT)
        np.testing.assert_array_equal(fused.whole(group), plain)
        assert calls and fused.calls == 2
        calls.clear()
