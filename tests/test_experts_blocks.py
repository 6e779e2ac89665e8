"""The expert drivers' work items: every row block of every expert, for every token group,
written, at 1 and 2 threads.

Independent of the drivers: each expert's rows by `q8.matmul` (its own driver, one product per
call) and each token's sum written out here in float32. The drivers' outputs start as NaN (not
`np.empty`: a skipped block could hold the right value from an earlier identical call), so a
block, an expert or a token group that no thread ran stays NaN; one run twice into a sum, or
at the wrong rows, changes the bits.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from dsv4stream import kernels
from dsv4stream.checkpoint import formats
from dsv4stream.kernels import cpu, experts_q8, q8
from dsv4stream.model.moe import _glu

HOST = cpu.variant("fp4")
needs_fast = pytest.mark.skipif(HOST is None or kernels.backend_name() != "fast", reason="no fast FP4 variant here")
THREADS = (1, 2) if numba.config.NUMBA_NUM_THREADS >= 2 else (1,)
D, INTER = 512, 256  # w1 / w3 (256, 512): 16 row blocks each; w2 (512, 256): 32


def _fp4(rng, r: int, c: int):
    d, s = formats.quantize_fp4((rng.standard_normal((r, c)) * 0.05).astype(np.float32))
    return d, s


def _setup(seed: int, tokens: int):
    """6 experts, `tokens` tokens each choosing 3 (expert 1 by every token: groups of 4, 2, 1)."""
    rng = np.random.default_rng(seed)
    ws = [{m: _fp4(rng, *((D, INTER) if m == "w2" else (INTER, D))) for m in ("w1", "w2", "w3")} for _ in range(6)]
    experts = np.stack([np.full(tokens, 1), rng.integers(2, 4, tokens), rng.integers(4, 6, tokens)], axis=1)
    weights = rng.uniform(0.1, 2.0, experts.shape).astype(np.float32)
    x = rng.standard_normal((tokens, D)).astype(np.float32)
    return ws, experts.astype(np.int64), weights, x


def _nan(shape) -> np.ndarray:
    return np.full(shape, np.nan, np.float32)


@needs_fast
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("tokens", [1, 7])
def test_drivers_write_every_row_block_of_every_expert_once(threads, tokens):
    ws, experts, weights, x = _setup(31 + tokens, tokens)
    rt = experts_q8.Routing(experts, weights)
    es = [ws[int(e)] for e in rt.ids]
    p = rt.tok.size
    # what each pair's rows must be: its expert's own products, one call per expert
    want_gate, want_up = np.empty((p, INTER), np.float32), np.empty((p, INTER), np.float32)
    for j, e in enumerate(es):
        xs = x[rt.tok[rt.lo[j] : rt.hi[j]]]
        want_gate[rt.lo[j] : rt.hi[j]] = q8.matmul(*e["w1"], xs, HOST)
        want_up[rt.lo[j] : rt.hi[j]] = q8.matmul(*e["w3"], xs, HOST)
    h = (want_gate * np.float32(0.5) - want_up).astype(np.float32)  # any rows: the down driver's input
    want_y = np.empty((p, D), np.float32)
    for j, e in enumerate(es):
        want_y[rt.lo[j] : rt.hi[j]] = q8.matmul(*e["w2"], h[rt.lo[j] : rt.hi[j]], HOST)
    want_out = np.zeros((tokens, D), np.float32)
    for t in range(tokens):
        for q in rt.tp[t]:
            want_out[t] = want_out[t] + (want_y[q] * rt.wp[q]).astype(np.float32)
    s = q8.span(HOST)
    t13 = experts_q8._address_table([[*e["w1"], *e["w3"]] for e in es])
    t2 = experts_q8._address_table([list(e["w2"]) for e in es])
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(threads)
        gate, up = _nan((p, INTER)), _nan((p, INTER))
        xg = np.ascontiguousarray(x[rt.tok])
        experts_q8.driver_for("pair", HOST)(t13, rt.lo, rt.hi, experts_q8.U8_LIKE, xg, s, gate, up, *q8.scratch(p, D))
        np.testing.assert_array_equal(gate, want_gate)
        np.testing.assert_array_equal(up, want_up)
        y, out = _nan((p, D)), _nan((tokens, D))
        down = experts_q8.driver_for("down", HOST)
        down(t2, rt.lo, rt.hi, experts_q8.U8_LIKE, h, s, rt.wp, rt.tp, y, out, *q8.scratch(p, INTER))
        np.testing.assert_array_equal(y, want_y)
        np.testing.assert_array_equal(out, want_out)
    finally:
        numba.set_num_threads(before)


def _fused_routing(form: str, seed: int):
    """(ws, experts, weights, x) of `form`: "prompt" 5 tokens choosing unequal experts (the
    SwiGLU over the pairs, then w2 by row blocks); "decode" one token choosing all 6; "even"
    5 tokens each choosing all 6 in its own order (5 pairs an expert: expert by expert, the sum
    in parallel row blocks)."""
    ws, experts, weights, x = _setup(seed, 5)
    if form == "prompt":
        return ws, experts, weights, x
    rng = np.random.default_rng(seed + 1)
    t = 1 if form == "decode" else 5
    experts = np.stack([rng.permutation(6) for _ in range(t)]).astype(np.int64)
    weights = rng.uniform(0.1, 2.0, experts.shape).astype(np.float32)
    return ws, experts, weights, x[:t]


@needs_fast
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("form", ["prompt", "decode", "even"])
def test_fused_drivers_write_every_row_block_once(threads, form, monkeypatch):
    """`swiglu_sum` from NaN buffers equals the two-call path at 1 and 2 threads, in both forms
    of its second driver (`experts_q8._per_expert`)."""
    monkeypatch.setattr(experts_q8, "_empty", lambda shape, dtype: np.full(shape, np.nan, dtype))
    ws, experts, weights, x = _fused_routing(form, 41)
    rt = experts_q8.Routing(experts, weights)
    assert experts_q8._per_expert(rt, threads) == (form != "prompt")
    assert (rt.tp.shape[0] > experts_q8.SERIAL_SUM_TOKENS) == (form != "decode")
    es = [ws[int(e)] for e in rt.ids]
    w1s, w2s, w3s = ([e[m] for e in es] for m in ("w1", "w2", "w3"))
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        gate, up = experts_q8.pair_products(HOST, x, rt, w1s, w3s)
        want = experts_q8.down_sum(HOST, _glu(gate, up, 7.0), rt, w2s)
        assert np.isfinite(want).all()
        numba.set_num_threads(threads)
        got = experts_q8.swiglu_sum(HOST, x, rt, w1s, w3s, w2s, 7.0)
        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    finally:
        numba.set_num_threads(before)


def test_per_expert_form_only_where_the_experts_split_evenly():
    one = experts_q8.Routing(np.array([[5, 1, 4, 0, 3, 2]]), np.ones((1, 6), np.float32))
    assert experts_q8._per_expert(one, 1) and experts_q8._per_expert(one, 2) and experts_q8._per_expert(one, 3)
    assert not experts_q8._per_expert(one, 4)  # 2, 2, 1, 1 experts a thread: row blocks instead
    three = experts_q8.Routing(np.array([[4, 0, 3]]), np.ones((1, 3), np.float32))
    assert not experts_q8._per_expert(three, 2)
    unequal = experts_q8.Routing(np.array([[0, 1], [0, 2]]), np.ones((2, 2), np.float32))  # expert 0: 2 pairs
    assert not experts_q8._per_expert(unequal, 1)
    equal = experts_q8.Routing(np.array([[0, 1], [1, 0]]), np.ones((2, 2), np.float32))
    assert experts_q8._per_expert(equal, 2)
