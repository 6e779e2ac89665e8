"""The last layer computes only the rows whose outputs are used (`Session._rows_used`, `Stack.layer`'s
keep): a pass that wants the last position's logits runs the last layer's query path, mixing and
MoE on that row alone, a prefill segment before the last on none, while every row still updates
the state. Checked on an oracle fixture of each family (widths the fast kernels take), in exact,
official and fast: the last logits and the decode after them equal, bit for bit, those of a pass
that keeps every row (logits for all positions, which never skips), in one segment and in
segments of 5 with attention sub-chunks of 3; the skip does happen (the last layer routes one
row, or none before the last segment); a trace still sees every row of every layer; a drafter's
taps keep the skip and are the same rows bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dsv4stream.engine.session import Engine

FIXTURES = Path(__file__).parent / "fixtures"
CASES = {"v4": (FIXTURES / "mixed", 13), "v41": (FIXTURES / "v41" / "wide", 21)}
SHAPES = [(64, None), (3, 5)]  # (attention sub-chunk, prefill segment): one segment; three segments


def _ids(eng: Engine, n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(2, eng.cfg.vocab_size, n)


@pytest.mark.parametrize("numerics", ["exact", "official", "fast"])
@pytest.mark.parametrize("family", sorted(CASES))
def test_the_last_logits_and_the_decode_after_them_equal_a_pass_that_keeps_every_row(family, numerics):
    path, n = CASES[family]
    eng = Engine.open(path, numerics=numerics)
    ids = _ids(eng, n)
    for chunk, segment in SHAPES:
        cut, whole = (eng.session(chunk_size=chunk, segment=segment) for _ in range(2))
        got, want = cut.prefill(ids, last_only=True), whole.prefill(ids)[-1]
        assert np.array_equal(got, want), (chunk, segment)
        tok = int(got.argmax())
        for _ in range(3):  # the state of every layer saw every row: the next steps agree too
            a, b = cut.step(tok), whole.step(tok)
            assert np.array_equal(a, b), (chunk, segment)
            tok = int(a.argmax())


@pytest.mark.parametrize("family", sorted(CASES))
def test_the_last_layer_routes_the_last_row_alone_and_no_row_before_the_last_segment(family):
    path, n = CASES[family]
    eng = Engine.open(path, numerics="fast")
    last = eng.cfg.n_layers - 1
    routed: list[tuple[int, list[int]]] = []
    on_route = lambda layer, positions, experts: routed.append((layer, positions.tolist()))
    s = eng.session(chunk_size=3, segment=5, on_route=on_route, record_requests=True)
    s.prefill(_ids(eng, n), last_only=True)
    assert [p for layer, p in routed if layer == last] == [[n - 1]]
    assert [p for layer, p in routed if layer == last - 1] == [list(range(a, min(a + 5, n))) for a in range(0, n, 5)]
    few = len(s.requests)
    routed.clear()
    s = eng.session(chunk_size=3, segment=5, on_route=on_route, record_requests=True)
    s.prefill(_ids(eng, n))  # every position's logits: every row of every layer
    assert [p for layer, p in routed if layer == last] == [list(range(a, min(a + 5, n))) for a in range(0, n, 5)]
    assert len(s.requests) > few


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_traced_pass_computes_every_row_of_the_last_layer(family):
    """A trace (the oracle checks', a drafter's taps) reads each layer's rows: no skip there."""
    path, n = CASES[family]
    eng = Engine.open(path, numerics="exact")
    ids = _ids(eng, n)
    seen: dict[tuple[str, int], int] = {}

    def trace(what: str, layer: int, x: np.ndarray) -> None:
        seen[(what, layer)] = seen.get((what, layer), 0) + x.shape[0]

    got = eng.session(trace=trace).prefill(ids, last_only=True)
    last = eng.cfg.n_layers - 1
    assert seen[("input", last)] == n
    assert seen.get(("ffn", last), n) == n and seen.get(("hidden", last), n) == n
    assert np.array_equal(got, eng.session().prefill(ids, last_only=True))


def test_drafting_keeps_the_skip_and_the_drafter_sees_the_same_taps():
    """A drafter's taps (the streams entering its target layers, the last one included on this
    fixture) are whole before the cut: the prompt's last layer routes one row while drafting, and
    the drafter observes the same rows, bit for bit, as when an inner trace turns the skip off."""
    from dsv4stream.engine.spec_policy import FixedDrafts
    from dsv4stream.engine.speculate import speculative_generate
    from dsv4stream.engine.speculate_v41 import DSparkDrafter

    path = FIXTURES / "v41" / "dspark"
    eng = Engine.open(path, numerics="fast")
    with np.load(path / "draft.npz") as z:
        prompt = z["token_ids"][:8]
    last = eng.cfg.n_layers - 1
    assert last in DSparkDrafter(eng).targets

    def run(trace):
        routed, seen = [], []
        on_route = lambda layer, positions, experts: routed.append((layer, positions.tolist()))
        s = eng.session(chunk_size=3, on_route=on_route, trace=trace)
        d = DSparkDrafter(eng)
        observe = d.observe
        d.observe = lambda taps, positions: (
            seen.append((np.stack(taps, 1), positions.copy())),
            observe(taps, positions),
        )
        ids = list(speculative_generate(s, prompt, 8, lambda lg: int(np.argmax(lg)), d, FixedDrafts(3)))
        prompt_routes = [p for layer, p in routed if layer == last and p[0] < prompt.size]
        return ids, prompt_routes, seen

    ids, routes, seen = run(None)
    ids_whole, routes_whole, seen_whole = run(lambda what, layer, x: None)  # reads outputs: no skip
    assert routes[0] == [prompt.size - 1] and routes_whole[0] == list(range(prompt.size))
    assert ids == ids_whole and len(seen) == len(seen_whole)
    for (a, pa), (b, pb) in zip(seen, seen_whole, strict=True):
        assert np.array_equal(a, b) and np.array_equal(pa, pb)
