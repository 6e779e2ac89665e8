"""Streaming providers and the budgeted runtime on generated checkpoints with the release layout:
token ids identical at every budget and to the in-memory Engine, the trunk streamed through
its ring in fixed order, zero hits below the working set on a cyclic route, one pin at a time,
layer weights as views of a slot, --verify on every read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dsv4stream import synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.engine.session import Engine
from dsv4stream.errors import BudgetError
from dsv4stream.run import planner
from dsv4stream.run.memory import measure
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.store import ExpertStore
from dsv4stream.store.directio import aligned_buffer
from dsv4stream.streaming.expert_layout import expert_layouts
from dsv4stream.streaming.experts import StreamedExperts
from dsv4stream.streaming.layout import trunk_layout
from dsv4stream.streaming.reader import GroupReader
from dsv4stream.streaming.ring import ViewSource
from dsv4stream.trunkpack.writer import pack_trunk
from dsv4stream.weights.loading_v4 import load_layer
from dsv4stream.weights.providers import CatalogTrunk

PROMPT = [3, 17, 101, 5, 250, 7, 9, 64, 33, 2]
GEN = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return synth.make_checkpoint(tmp_path_factory.mktemp("s") / "tiny", preset="tiny", seed=3)


@pytest.fixture(scope="module")
def reference_ids(ckpt) -> list[int]:
    return list(Engine.open(ckpt).session(chunk_size=4).generate(PROMPT, GEN))


def budget_for(ckpt: Path, slots: int, pinned: int | None = None, **kw) -> int:
    """The smallest budget whose plan gives `slots` expert slots and `pinned` trunk layers (all: None)."""
    n = measure(ckpt, RunOptions(budget=1, overhead=0, chunk=4, **kw))
    b = planner.budget_for(n, slots, pinned)
    got = planner.plan(n, b)
    assert (got.pinned_layers, got.expert_slots) == (len(n.layer_bytes) if pinned is None else pinned, slots), got
    return b


def run(ckpt: Path, budget: int, prompt=PROMPT, gen=GEN, **kw):
    with Runtime.open(ckpt, RunOptions(budget=budget, overhead=0, chunk=4, **kw)) as rt:
        ids = list(rt.generate(rt.session(), prompt, gen))
        return ids, rt.stats(), rt.plan


def test_ids_identical_below_above_and_holding_everything(ckpt, reference_ids) -> None:
    ws = Catalog.open(ckpt).config.working_set_experts  # 8
    for slots, warned in ((ws - 3, True), (ws + 2, False), (32, False)):
        ids, stats, plan = run(ckpt, budget_for(ckpt, slots))
        assert plan.expert_slots == slots and stats.cache_slots == slots
        assert any("working set" in w for w in plan.warnings) == warned
        assert ids == reference_ids, f"{slots} slots"
        assert stats.generated_ids == ids and stats.trunk_streamed_layers == 0


def test_hit_rates_grow_with_the_budget(ckpt) -> None:
    rates = [run(ckpt, budget_for(ckpt, s))[1].hit_rate for s in (5, 10, 32)]
    assert rates[0] < rates[1] < rates[2]


@pytest.mark.parametrize("pinned", [0, 1])
def test_trunk_below_the_budget_streams_through_the_ring_with_the_same_ids(ckpt, reference_ids, pinned) -> None:
    ids, stats, plan = run(ckpt, budget_for(ckpt, 5, pinned=pinned))
    n_layers = Catalog.open(ckpt).config.n_layers
    assert (plan.pinned_layers, plan.ring_slots) == (pinned, 2)
    assert ids == reference_ids
    streamed = n_layers - pinned
    forwards = (
        -(-len(PROMPT) // plan.prefill_segment) + GEN - 1
    )  # prefill segments, then one step per token but the last
    assert stats.trunk_streamed_layers == streamed and stats.trunk_out_of_order == 0
    # every streamed layer once per segment or step, in order, plus the read of the next forward's first
    assert stats.trunk_reads == forwards * streamed + 1


def test_packed_trunk_streams_the_same_ids_and_verifies(ckpt, reference_ids, tmp_path) -> None:
    trunk = pack_trunk(ckpt, tmp_path / "trunk", progress=False).path
    ids, stats, _ = run(ckpt, budget_for(ckpt, 5, pinned=1, trunk=trunk), trunk=trunk, verify=True)
    assert ids == reference_ids
    assert stats.trunk_reads > 0 and stats.trunk_verified_reads >= stats.trunk_reads
    assert stats.verified_reads == stats.expert_misses + stats.expert_prefetches - stats.prefetch_used


def test_verify_checks_every_expert_read(ckpt, reference_ids) -> None:
    ids, s, _ = run(ckpt, budget_for(ckpt, 32), verify=True)
    assert ids == reference_ids
    assert s.verify_mismatches == 0 and s.verified_reads == s.expert_misses > 0


def test_hit_rate_is_exactly_zero_below_the_working_set_on_a_cyclic_route(tmp_path) -> None:
    # a steep popularity makes every token take the same experts in every layer: a cyclic route
    ck = synth.make_checkpoint(tmp_path / "cyclic", preset="tiny", seed=1, route_skew=100.0)
    route = tmp_path / "route.log"
    cfg = Catalog.open(ck).config
    ws, k = cfg.working_set_experts, cfg.num_experts_per_tok
    _, below, plan = run(ck, budget_for(ck, ws - k), route_log=route, gen=6)
    lines = route.read_text().split("\n")[:-1]
    per_pass = lines[:ws]
    assert len(set(per_pass)) == ws and lines == per_pass * (len(lines) // ws)  # really cyclic
    assert below.expert_requests == len(lines) and below.expert_hits == 0
    assert any("working set" in w for w in plan.warnings)
    # With ws - k < slots < ws, a layer's prefetch touches the experts it still finds before
    # loading the others, so some survive (one layer of look-ahead); at ws every pass after
    # the first hits everything.
    assert 0 < run(ck, budget_for(ck, ws - 1), gen=6)[1].expert_hits < below.expert_requests - ws
    _, at, p = run(ck, budget_for(ck, ws), gen=6)
    # only the compulsory misses, and the experts the prompt's segment displaced: its activations
    # borrowed the bytes of `lent` slots, which the first decode step gets back empty
    lent = p.expert_slots - p.prefill_slots(len(PROMPT))
    assert at.prefill_lent_slots == lent > 0 and at.expert_misses == ws + lent


def test_budget_below_the_minimum_names_it(ckpt) -> None:
    n = measure(ckpt, RunOptions(budget=1, overhead=0))
    floor = planner.minimum_budget(n)
    with pytest.raises(BudgetError, match=r"below the minimum of .* raise --budget"):
        Runtime.open(ckpt, RunOptions(budget=floor - 1, overhead=0))
    with Runtime.open(ckpt, RunOptions(budget=floor, overhead=0)) as rt:
        # decoding needs 2 x k slots; at the floor the pool is what a 64-token segment needs beside
        # PREFILL_SLOTS slots, and decoding has all of it as slots
        p, stb = rt.plan, n.segment_token_bytes
        assert p.pinned_layers == 0 and p.prefill_segment == 64 and p.prefill_slots(64) == planner.PREFILL_SLOTS
        assert p.pool_bytes == planner.PREFILL_SLOTS * n.slot_bytes + 64 * stb
        assert p.expert_slots == (p.pool_bytes - stb) // n.slot_bytes >= 2 * rt.cfg.num_experts_per_tok


def test_pins_never_exceed_the_slots_even_below_the_planned_minimum(ckpt, reference_ids) -> None:
    cat = Catalog.open(ckpt)
    el = expert_layouts(cat.entries, cat.config.n_layers)
    outstanding, widest = [], []

    class CountingStore(ExpertStore):
        def _acquire(self, key):
            out = super()._acquire(key)
            outstanding.append(sum(e.pins for e in self._lru.entries.values()))
            return out

        def _many(self, keys, together):  # get_many and get_groups
            keys = list(keys)
            widest.append(len(keys))
            return super()._many(keys, together)

    k = cat.config.num_experts_per_tok
    with CountingStore(el.layouts, slots=k, order=el.order) as store:  # fewer slots than planned minimum
        experts = StreamedExperts(store, cat.config)
        ids = list(Engine(cat.config, CatalogTrunk(cat), experts, cat).session(chunk_size=4).generate(PROMPT, GEN))
    assert ids == reference_ids
    assert max(widest) > k and max(outstanding) == k  # a layer wanted more experts than slots: taken in turns


def test_layer_weights_are_views_of_the_slot(ckpt) -> None:
    cat = Catalog.open(ckpt)
    layout = trunk_layout(cat)
    g = layout.layers[1]
    buf = aligned_buffer(g.nbytes)
    arrays = GroupReader("direct", verify=True).read(g, buf)
    w = load_layer(ViewSource(cat.config, g.entries, arrays), 1)
    ref = load_layer(cat, 1)
    assert np.shares_memory(w.attn.wq_a.data, buf) and np.shares_memory(w.moe.shared.w2.data, buf)
    assert np.array_equal(w.attn.wq_a.data, ref.attn.wq_a.data) and np.array_equal(w.attn.sink, ref.attn.sink)
    assert np.array_equal(w.moe.gate.data, ref.moe.gate.data) and np.array_equal(w.hc_ffn.base, ref.hc_ffn.base)
    # the shards' layer groups are read in a few windows, not one per tensor
    assert len(g.plan.windows) < len(g.entries)


def test_hash_layer_experts_are_requested_as_soon_as_the_token_is_known(ckpt) -> None:
    # four slots: the previous pass's hash-layer experts are long evicted when a token comes out
    with Runtime.open(ckpt, RunOptions(budget=budget_for(ckpt, 4), overhead=0, chunk=4)) as rt:
        hash_layers = range(rt.cfg.num_hash_layers)
        gen = rt.generate(rt.session(), PROMPT, GEN)
        for n, tok in enumerate(gen):
            if n + 1 < GEN:  # the last token is not fed, so nothing is fetched for it
                want = {(i, int(e)) for i in hash_layers for e in rt.trunk.tid2eid(i)[tok]}
                assert want <= set(rt.store._lru.entries), "hash-layer experts not started before the next forward"


def test_verify_catches_a_misplaced_trunk_layer(ckpt, monkeypatch) -> None:
    from dsv4stream.errors import VerifyError
    from dsv4stream.streaming import reader

    def shifted(buf, layout, plan):  # every tensor one byte off: the bug the verifier is for
        return real(buf[1:], layout, plan)

    real = reader.piece_views
    monkeypatch.setattr(reader, "piece_views", shifted)
    with pytest.raises(VerifyError, match=r"layer 0 tensor layers\.0\..* bytes differ"):
        Runtime.open(ckpt, RunOptions(budget=budget_for(ckpt, 8), overhead=0, chunk=4, verify=True))


def test_weights_kept_past_their_lifetime_fail_loudly(ckpt) -> None:
    """A streamed layer is valid until the next layer() call, a streamed expert until the next
    get (or until get_many advances): touching one later raises, naming what it was."""
    from dsv4stream.errors import LifetimeError

    with Runtime.open(ckpt, RunOptions(budget=budget_for(ckpt, 5, pinned=0), overhead=0, chunk=4)) as rt:
        trunk, experts = rt.trunk, rt.experts
        w0 = trunk.layer(0)
        assert w0.attn.wq_a.rows > 0 and w0.attn_norm.size  # in its lifetime: the real thing
        w1 = trunk.layer(1)  # the ring now reads layer 2 into layer 0's slot
        with pytest.raises(LifetimeError, match="layer 0's weights used after the ring"):
            _ = w0.attn.wq_a
        with pytest.raises(LifetimeError):
            _ = w0.attn_norm * 2
        assert w1.attn.wq_a.rows > 0
        a = experts.get(1, 0)
        assert a.w1.rows > 0
        experts.get(1, 1)
        with pytest.raises(LifetimeError, match="layer 1 expert 0's weights used after their release"):
            _ = a.w1.rows
        items = experts.get_many(1, [2, 3])
        _, first = next(items)
        assert first.w2.rows > 0
        next(items)
        with pytest.raises(LifetimeError, match="get_many moved on"):
            _ = first.w2.data
        items.close()
        # the engine keeps to both contracts: a whole generation at this budget still runs
        assert len(list(rt.generate(rt.session(), PROMPT, 3))) == 3


def test_live_counters_never_wait_for_a_trunk_read_in_flight(ckpt, monkeypatch) -> None:
    """The prefill bar, /v1/stats and /metrics read `Runtime.counters()` while the engine works:
    it must answer while a streamed layer's read is still in flight (the ring's stats() waits
    for it, so that the run's final figures do not depend on timing)."""
    import threading

    from dsv4stream.cli.repl import reads_of
    from dsv4stream.server.stats import LiveStats

    gate, plain = threading.Event(), GroupReader.read

    def held(self, group, buf):
        if threading.current_thread().name.startswith("dsv4-ring"):
            gate.wait(30)  # the ring's read of the first streamed layer, held until the test lets go
        return plain(self, group, buf)

    monkeypatch.setattr(GroupReader, "read", held)
    with Runtime.open(ckpt, RunOptions(budget=budget_for(ckpt, 8, pinned=1), overhead=0, chunk=4)) as rt:
        try:
            got: dict = {}
            calls = {
                "counters": rt.counters,
                "bar": reads_of(rt),
                "snapshot": lambda: LiveStats(rt).snapshot(0),
                "metrics": lambda: LiveStats(rt).counters(),
            }
            for name, call in calls.items():
                t = threading.Thread(target=lambda n=name, c=call: got.__setitem__(n, c()), daemon=True)
                t.start()
                t.join(5)
                assert not t.is_alive(), f"{name} waited for the read in flight"
            assert got["counters"].trunk_bytes_read == 0 and got["snapshot"]["trunk"]["streamed_layers"] > 0
            blocked = threading.Thread(target=rt.trunk.stats, daemon=True)
            blocked.start()
            blocked.join(0.3)
            assert blocked.is_alive()  # the final figures do wait: the test holds a read in flight
        finally:
            gate.set()
        assert rt.trunk.stats().bytes_read > 0  # the held read landed once let go, and counts
