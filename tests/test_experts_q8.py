"""The layer-wide FP4 x int8 expert drivers (kernels/experts_q8.py) and the MoE's use of them.

Independent of the drivers: each expert's products by `q8.matmul` (tested against float64 in
test_numerics_kernels.py), the SwiGLU in numpy, and each token's weighted sum in ascending
expert id order written out here. The drivers must give those bits exactly (the rows of a
batch equal solo steps only if they do), for E8M0 and float32 scales, token groups of 4, 2
and 1, an expert listed twice by one token, a layer handed in any groups (`experts_q8.Layer`:
the store's pins) with calls of any size, the host variant and AVX2 in this process, and
AVX2 compiled for a Haswell target in a child process (generic: no driver, the old path), the
fused layer call (test_experts_fused.py) in that child too.
The MoE runs a layer whose experts come in one group in two driver calls.
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numba
import numpy as np
import pytest

from dsv4stream import kernels
from dsv4stream.checkpoint import formats
from dsv4stream.kernels import QWeight, cpu, experts_q8, q8
from dsv4stream.model import moe

HOST = cpu.variant("fp4")
needs_fast = pytest.mark.skipif(HOST is None or kernels.backend_name() != "fast", reason="no fast FP4 variant here")
D, INTER, LIMIT = 512, 256, 7.0


def fp4(rng, r: int, c: int, f32_scale: bool = False) -> QWeight:
    d, s = formats.quantize_fp4((rng.standard_normal((r, c)) * 0.05).astype(np.float32))
    if f32_scale:
        s = formats.e8m0_to_f32(s)
    return QWeight("fp4", d, s, r, c, role="experts")


def expert(rng, f32_scale: bool = False) -> moe.ExpertWeights:
    return moe.ExpertWeights(
        w1=fp4(rng, INTER, D, f32_scale), w2=fp4(rng, D, INTER, f32_scale), w3=fp4(rng, INTER, D, f32_scale)
    )


def glu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return moe._glu(gate, up, LIMIT)


def reference(variant: str, x, experts, weights, table) -> np.ndarray:
    """Per expert q8.matmul, numpy SwiGLU, per token ascending (id, slot) weighted sum."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in np.lexsort((np.arange(experts.shape[1]), experts[t])):
            e = table[int(experts[t, j])]
            xt = x[t : t + 1]
            h = glu(q8.matmul(e.w1.data, e.w1.scale, xt, variant), q8.matmul(e.w3.data, e.w3.scale, xt, variant))
            y = q8.matmul(e.w2.data, e.w2.scale, h, variant)[0]
            out[t] += y * weights[t, j]
    return out


def layer(variant: str, x, experts, weights, table) -> np.ndarray:
    rt = experts_q8.Routing(experts, weights)
    es = [table[int(e)] for e in rt.ids]
    parts = experts_q8._parts
    gate, up = experts_q8.pair_products(variant, x, rt, [parts(e.w1) for e in es], [parts(e.w3) for e in es])
    return experts_q8.down_sum(variant, glu(gate, up), rt, [parts(e.w2) for e in es])


def routing(rng, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Every token picks expert 2 (7 tokens: groups 4, 2, 1), token 1 lists expert 5 twice."""
    experts = np.stack([np.full(t, 2), rng.integers(0, 6, t), rng.integers(0, 6, t)], axis=1).astype(np.int64)
    experts[1, 1:] = 5
    return experts, rng.uniform(0.1, 2.0, experts.shape).astype(np.float32)


def pair_rows(variant: str, x, experts, weights, e: int, ew) -> np.ndarray:
    """Expert e's weighted rows, one per (token, slot) choosing it, in that order (`Layer.put`)."""
    rows = []
    for t, j in zip(*np.nonzero(experts == e), strict=True):
        xt = x[t : t + 1]
        h = glu(q8.matmul(ew.w1.data, ew.w1.scale, xt, variant), q8.matmul(ew.w3.data, ew.w3.scale, xt, variant))
        rows.append(q8.matmul(ew.w2.data, ew.w2.scale, h, variant)[0] * weights[t, j])
    return np.array(rows, np.float32)


def in_groups(variant: str, x, experts, weights, table, rng, put: int | None = None) -> np.ndarray:
    """The layer through `experts_q8.Layer` with its experts in random groups, in random order;
    expert `put` handed as finished rows."""
    lay = experts_q8.Layer(variant, x, experts, weights, glu)
    ids = [int(e) for e in rng.permutation(np.unique(experts)) if e != put]
    cuts = sorted(rng.choice(np.arange(1, len(ids)), size=min(2, len(ids) - 1), replace=False).tolist())
    for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True):
        group = [(e, table[e]) for e in ids[a:b]]
        assert lay.whole(group) is None  # not every expert: no two-call shortcut
        lay.group(group)
    if put is not None:
        lay.put(put, pair_rows(variant, x, experts, weights, put, table[put]))
    return lay.total()


def check_layer_drivers(variant: str) -> None:
    rng = np.random.default_rng(11)
    for f32_scale in (False, True):
        table = {e: expert(rng, f32_scale) for e in range(6)}
        x = (rng.standard_t(3, (7, D)) * 2).astype(np.float32)
        experts, weights = routing(rng, 7)
        want = reference(variant, x, experts, weights, table)
        np.testing.assert_array_equal(layer(variant, x, experts, weights, table), want)
        np.testing.assert_array_equal(layer(variant, x[3:4], experts[3:4], weights[3:4], table), want[3:4])
        np.testing.assert_array_equal(in_groups(variant, x, experts, weights, table, rng), want)
        np.testing.assert_array_equal(in_groups(variant, x, experts, weights, table, rng, put=5), want)
        before = experts_q8.PAIR_ROWS
        experts_q8.PAIR_ROWS = 3  # expert 2's 7 pairs in three calls, other experts cut at call ends
        try:
            np.testing.assert_array_equal(in_groups(variant, x, experts, weights, table, rng), want)
            one = experts_q8.Layer(variant, x, experts, weights, glu)
            group = [(e, table[e]) for e in range(6) if e in experts]
            assert one.whole(group) is None  # more pairs than one call takes
            one.group(group)
            np.testing.assert_array_equal(one.total(), want)
            assert one.calls == 2 * 7 + 1  # 21 pairs, 3 a call: 7 pairs of calls, then the sum
        finally:
            experts_q8.PAIR_ROWS = before


@needs_fast
@pytest.mark.parametrize("variant", ["host", "avx2"])
def test_layer_drivers_equal_per_expert_products(variant):
    check_layer_drivers(HOST if variant == "host" else "avx2")


@needs_fast
def test_layer_drivers_do_not_depend_on_threads():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one numba thread")
    rng = np.random.default_rng(12)
    table = {e: expert(rng) for e in range(6)}
    x = rng.standard_normal((5, D)).astype(np.float32)
    experts, weights = routing(rng, 5)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = layer(HOST, x, experts, weights, table)
        numba.set_num_threads(2)
        np.testing.assert_array_equal(layer(HOST, x, experts, weights, table), one)
    finally:
        numba.set_num_threads(before)


@pytest.fixture
def fast_mode():
    kernels.set_numerics("fast")
    yield
    kernels.set_numerics("exact")


@needs_fast
def test_moe_runs_a_layer_in_two_driver_calls_with_the_separate_products_bits(fast_mode, monkeypatch):
    rng = np.random.default_rng(13)
    table = {e: expert(rng) for e in range(6)}
    x = rng.standard_normal((5, D)).astype(np.float32)
    experts, weights = routing(rng, 5)
    experts[0] = [0, 3, 4]  # token 0 alone: k distinct experts (a decode step's layer)
    layers = []
    real = moe.q8_layer
    monkeypatch.setattr(moe, "q8_layer", lambda *a, **k: layers.append(real(*a, **k)) or layers[-1])
    together = moe.GroupedSource(lambda ids: iter([[(int(e), table[int(e)]) for e in ids[::-1]]]))
    fused = moe.routed_experts(x, experts, weights, together, LIMIT)
    solo = moe.routed_experts(x[:1], experts[:1], weights[:1], together, LIMIT)
    assert [lay.calls for lay in layers] == [2, 2]  # pair_products and down_sum, whatever the rows

    def each(ids):  # one expert at a time, arrival order reversed: two calls each, then the sum
        for e in ids[::-1]:
            yield int(e), table[int(e)]

    layers.clear()
    np.testing.assert_array_equal(moe.routed_experts(x, experts, weights, each, LIMIT), fused)
    assert [lay.calls for lay in layers] == [2 * np.unique(experts).size + 1]
    monkeypatch.setattr(experts_q8, "variant_of", lambda *a: None)  # the separate products
    np.testing.assert_array_equal(moe.routed_experts(x, experts, weights, each, LIMIT), fused)
    np.testing.assert_array_equal(moe.routed_experts(x[:1], experts[:1], weights[:1], each, LIMIT), solo)
    np.testing.assert_array_equal(solo, fused[:1])
    np.testing.assert_array_equal(fused, reference(HOST, x, experts, weights, table))


@needs_fast
def test_an_expert_the_drivers_do_not_take_joins_the_layer_with_its_own_products(fast_mode, monkeypatch):
    """A layer with one expert on the per-expert path (e.g. a width the drivers do not take): its
    weighted rows join the drivers' sum, the same bits as every expert on its own products."""
    rng = np.random.default_rng(15)
    table = {e: expert(rng) for e in range(6)}
    x = rng.standard_normal((4, D)).astype(np.float32)
    experts, weights = routing(rng, 4)
    together = moe.GroupedSource(lambda ids: iter([[(int(e), table[int(e)]) for e in ids]]))
    real = experts_q8.variant_of
    monkeypatch.setattr(experts_q8, "variant_of", lambda e, *a: None if e is table[2] else real(e, *a))
    mixed = moe.routed_experts(x, experts, weights, together, LIMIT)
    monkeypatch.setattr(experts_q8, "variant_of", lambda *a: None)
    np.testing.assert_array_equal(mixed, moe.routed_experts(x, experts, weights, together, LIMIT))


@needs_fast
def test_v41_moe_weights_before_w2_on_the_drivers_with_its_per_expert_bits(fast_mode, monkeypatch):
    """V4.1 multiplies h by the routing weight before w2: its layer on the drivers (two calls, or
    two per expert and the sum when experts come one by one) gives the bits of its per-expert
    products (`variant_of` None: the path every V4.1 layer took before), in exact the per-expert
    path too; the weights after w2 (V4's order) would not."""
    from dsv4stream.model.v41 import moe as moe41

    rng = np.random.default_rng(16)
    table = {e: expert(rng) for e in range(6)}
    gate = QWeight("f32", (rng.standard_normal((6, D)) * 0.05).astype(np.float32), None, 6, D)
    w = moe41.V41MoeWeights(gate=gate, bias=np.zeros(6, np.float32), bias_vl=None, shared=expert(rng))
    p = moe41.V41MoeParams(k=3, scaling=2.5, limit=LIMIT, norm_topk_prob=True, quantise=False)
    x = (rng.standard_t(3, (7, D)) * 2).astype(np.float32)
    layers = []
    real = moe.q8_layer
    monkeypatch.setattr(moe, "q8_layer", lambda *a, **k: layers.append(real(*a, **k)) or layers[-1])
    together = moe.GroupedSource(lambda ids: iter([[(int(e), table[int(e)]) for e in ids[::-1]]]))

    def each(ids):
        for e in ids[::-1]:
            yield int(e), table[int(e)]

    fused = moe41.moe(x, w, together, p)
    experts, _ = moe41.route(x, w, p)
    assert [lay.calls for lay in layers] == [2]
    layers.clear()
    np.testing.assert_array_equal(moe41.moe(x, w, each, p), fused)
    assert [lay.calls for lay in layers] == [2 * np.unique(experts).size + 1]
    np.testing.assert_array_equal(moe41.moe(x[2:3], w, together, p), fused[2:3])
    ids = np.unique(experts)
    after = moe.layer_sum(x, experts, moe41.route(x, w, p)[1], ids, together, partial(moe41._glu, limit=LIMIT), None)
    assert not np.array_equal(after + moe41._rows(x, w.shared, p, None, None), fused)  # V4's order: other bits
    monkeypatch.setattr(experts_q8, "variant_of", lambda *a: None)  # each expert's own products
    np.testing.assert_array_equal(moe41.moe(x, w, each, p), fused)
    kernels.set_numerics("exact")
    exact = moe41.moe(x, w, each, p)
    assert not np.array_equal(exact, fused) and np.allclose(exact, fused, rtol=0.1, atol=0.05 * np.abs(exact).max())


def test_exact_numerics_and_the_reference_backend_never_take_the_drivers():
    rng = np.random.default_rng(14)
    kernels.set_numerics("exact")  # (a process global: an earlier file's engine may have left it at fast)
    assert kernels.q8_expert_variant(expert(rng)) is None
    if HOST is None or kernels.backend_name() != "fast":
        return
    kernels.set_numerics("fast")
    try:
        assert kernels.q8_expert_variant(expert(rng)) == HOST
        kernels.set_backend("reference")
        assert kernels.q8_expert_variant(expert(rng)) is None  # not the variant found under numba
    finally:
        kernels.set_backend("fast")
        kernels.set_numerics("exact")


@needs_fast
@pytest.mark.parametrize("target,variant", [("haswell", "avx2"), ("generic", None)])
def test_other_targets(target, variant, tmp_path):
    """Compiled for another CPU target in a child (numba's cache is keyed by it): Haswell runs
    the AVX2 drivers bit-equal to AVX2's per-expert products; generic has none (SIGILL if a
    driver for a missing instruction were run: the child would die, not fail an assert)."""
    env = {**os.environ, "NUMBA_CPU_NAME": target, "NUMBA_CPU_FEATURES": ""}
    root = str(Path(__file__).parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, str(Path(__file__).parent), env.get("PYTHONPATH")) if p)
    r = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900, check=False, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [str(variant), "ok"]


def _child() -> None:
    v = cpu.variant("fp4")
    kernels.set_numerics("fast")
    if v is not None:
        check_layer_drivers(v)
        from test_experts_fused import check_swiglu_sum  # the fused layer call (SwiGLU inside)

        check_swiglu_sum(v)
    else:
        assert kernels.q8_expert_variant(expert(np.random.default_rng(0))) is None
    print(v, "ok")


if __name__ == "__main__":
    _child()
