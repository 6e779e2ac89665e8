"""Layer-major prefill on a generated V4 checkpoint: a prompt whose activations fit goes through
as one segment in the bytes of lent slots, the planner's segment and its override, a stop within
one layer, the embedding rows read before the hash layers' experts. The invariants every family
keeps (one read per expert per segment, the same ids at every segment size and budget, the state
the planner counts) are in test_engine_invariants.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_probes import count_expert_reads, streaming

from dsv4stream.engine.session import Engine, PrefillStep
from dsv4stream.errors import BudgetError, UsageError
from dsv4stream.run import planner
from dsv4stream.run.memory import measure
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime

PROMPT = np.random.default_rng(7).integers(2, 500, 48).tolist()


@pytest.fixture(scope="module")
def ckpt(tiny_v4) -> Path:
    return tiny_v4


@pytest.fixture(scope="module")
def reference(ckpt) -> list[int]:
    """Greedy ids of the in-memory engine fed one token per forward pass."""
    return list(Engine.open(ckpt).session(chunk_size=1, segment=1).generate(PROMPT, 6))


def test_a_prompt_whose_activations_fit_is_one_segment_in_the_bytes_of_lent_slots(ckpt, reference, monkeypatch):
    """The elastic plan: a budget whose pool holds 2 slots beside the prompt's activations,
    or ~10 slots when decoding. The prompt goes through as one segment, in the bytes of the
    slots the store lends for it, and reads each (layer, expert) it touches exactly once
    although the decode cache is smaller than what it touches; the first decode step takes
    every slot back; the ids are the in-memory engine's."""
    reads = count_expert_reads(monkeypatch)
    n = measure(ckpt, RunOptions(budget=1, overhead=0, chunk=4))
    stb = n.segment_token_bytes
    budget = n.fixed_bytes + sum(n.layer_bytes) + planner.PREFILL_SLOTS * n.slot_bytes + len(PROMPT) * stb
    lent, touched = [], set()
    with Runtime.open(ckpt, RunOptions(budget=budget, overhead=0, chunk=4)) as rt:
        p = rt.plan
        assert p.prefill_segment == len(PROMPT) and p.prefill_slots(len(PROMPT)) == planner.PREFILL_SLOTS
        assert p.expert_slots == (p.pool_bytes - stb) // n.slot_bytes > planner.PREFILL_SLOTS
        assert p.planned_bytes == budget  # the prefill phase uses the pool to the byte

        def on_layer(step: PrefillStep) -> None:
            lent.append(rt.store.lent)
            assert len(rt.store.resident()) <= p.expert_slots - rt.store.lent

        def route(layer, positions, experts):
            if positions[0] < len(PROMPT):  # the prompt's (its last layer routes its last row alone)
                touched.update((layer, int(e)) for e in experts.ravel())

        got = []
        for tok in rt.generate(rt.session(on_route=route), PROMPT, 6, on_layer=on_layer):
            if not got:
                assert sum(reads.values()) == len(touched) and max(reads.values()) == 1  # each once
            got.append(tok)
        assert rt.store.lent == 0 and rt.most_lent == p.expert_slots - planner.PREFILL_SLOTS
        st = rt.stats()
    assert len(touched) > p.expert_slots and lent == [p.expert_slots - planner.PREFILL_SLOTS] * rt.cfg.n_layers
    assert got == reference and st.prefill_segment == len(PROMPT)


def test_planner_picks_the_segment_from_the_budget_and_counts_it(ckpt) -> None:
    n = measure(ckpt, RunOptions(budget=1, overhead=0, chunk=4))
    floor = planner.minimum_budget(n)
    small, large = planner.plan(n, floor), planner.plan(n, floor + 10**9)
    # at the floor, the bytes of decode's 4 slots hold 2 slots and a segment of 8 tokens
    assert n.slot_bytes * 2 // n.segment_token_bytes >= 8 and n.segment_min == 4
    assert small.expert_slots == 4 and small.prefill_segment == 8 and small.prefill_slots(8) == planner.PREFILL_SLOTS
    assert large.prefill_segment == planner.SEGMENT_CAP
    for p in (small, large):
        assert p.planned_bytes <= p.budget
        assert p.segment_bytes == p.prefill_segment * n.segment_token_bytes > 0
        assert any(f"segments of {p.prefill_segment} tokens" in line for line in p.lines())
    fixed = RunOptions(budget=floor + 10**9, overhead=0, chunk=4, prefill_segment=100)
    with Runtime.open(ckpt, fixed) as rt:
        assert rt.plan.prefill_segment == 100 and rt.session().segment == 100
    with pytest.raises(BudgetError, match="or --prefill-segment"):
        Runtime.open(ckpt, RunOptions(budget=floor, overhead=0, chunk=4, prefill_segment=10**6))
    with pytest.raises(UsageError, match="--prefill-segment 0"):
        Runtime.open(ckpt, RunOptions(budget=floor, prefill_segment=0))


def test_stop_from_the_layer_hook_acts_within_one_layer_and_tears_the_session(ckpt) -> None:
    eng = Engine.open(ckpt)
    cfg = eng.cfg
    s = eng.session(chunk_size=4, segment=16)
    seen: list[PrefillStep] = []

    class Stop(Exception):
        pass

    def on_layer(step: PrefillStep) -> None:
        seen.append(step)
        if step.segment == 2 and step.layer == 2:
            raise Stop

    with pytest.raises(Stop):
        s.prefill(PROMPT, on_layer=on_layer)
    assert len(seen) == cfg.n_layers + 2 and seen[-1].where() == f"layer 2/{cfg.n_layers}, segment 2/3"
    assert seen[-1].tokens == 16 + 16 * 2 / cfg.n_layers and s.pos == 16 and s.torn
    with pytest.raises(UsageError, match="start a new session"):
        s.step(1)


def test_runtime_reports_a_stopped_prefill(ckpt) -> None:
    with Runtime.open(ckpt, streaming(ckpt, 12, 4, prefill_segment=16)) as rt:

        def stop(step: PrefillStep) -> None:
            if step.segment == 2 and step.layer == 1:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            list(rt.generate(rt.session(), PROMPT, 4, on_layer=stop))
        st = rt.stats()
    assert st.prompt_tokens == 16 and st.prefill_segment == 16
    assert st.prefill_stopped == f"16 of {len(PROMPT)} tokens fed; stopped after layer 1/{rt.cfg.n_layers}, segment 2/3"


def test_the_prefill_bench_runs_the_segments_the_plan_counts(ckpt) -> None:
    """bench/prefill.py once fed the prompt through a session with the engine's default segment
    (4096 tokens) while the budget counted the plan's (1344): its peak RSS was the larger
    segment's. Its child must run the plan's segments."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prefill_bench", Path(__file__).parents[1] / "bench" / "prefill.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    floor = planner.minimum_budget(measure(ckpt, RunOptions(budget=1)))
    rec = bench.child(str(ckpt), (floor + 1000) / 1e9, 150, 2, 0, None)
    assert rec["segment"] == rec["planned_segment"] == planner.SUB_CHUNK and rec["segments"] == 3
    assert rec["planned_bytes"] <= floor + 1000


def test_a_segment_reads_its_embedding_rows_before_asking_for_its_hash_layer_experts(ckpt, monkeypatch) -> None:
    """Rows asked for after the hash layers' experts wait behind those reads (the reader
    threads hold the disk and take the GIL at every row's pread)."""
    eng = Engine.open(ckpt)
    assert eng.cfg.num_hash_layers >= 1
    calls: list[str] = []
    embed, prefetch = eng.trunk.embed, eng.experts.prefetch
    monkeypatch.setattr(eng.trunk, "embed", lambda ids: calls.append("embed") or embed(ids))
    hash_layers = range(eng.cfg.num_hash_layers)
    monkeypatch.setattr(
        eng.experts,
        "prefetch",
        lambda keys: calls.append("hash" if {k[0] for k in keys} <= set(hash_layers) else "scored") or prefetch(keys),
    )
    eng.session(chunk_size=4, segment=16).prefill(PROMPT[:40])
    segments = [calls[i : i + 2] for i, c in enumerate(calls) if c == "embed"]
    assert len(segments) == 3 and all(s == ["embed", "hash"] for s in segments)
    assert calls[0] == "embed"
