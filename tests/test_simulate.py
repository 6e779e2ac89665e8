"""Route-log replay: hand-computed counts, LRU's blind spot, Belady's bound, and the
simulator against the real ExpertStore driven with the same calls."""

import io
import json
import random
import time

import numpy as np
import pytest
from click.testing import CliRunner
from store_files import make_files

from dsv4stream.cli.bench import bench
from dsv4stream.errors import BudgetError, UsageError
from dsv4stream.measure import simulate as sim
from dsv4stream.store import ExpertStore

QUIET = {"warn": lambda m: None}
A, B, C, D = 0, 1, 2, 3
SMALL = [A, B, C, A, D, B, A, C]


@pytest.mark.parametrize(
    ("policy", "slots", "hits"),
    [
        # LRU, 2 slots: every request evicts what comes back next.  3 slots: A at 3 and 6.
        ("lru", 2, 0),
        ("lru", 3, 2),
        # Belady, 2 slots: C evicts B (A is next at 3), D evicts C (A at 6 < C at 7): A, A hit.
        ("belady", 2, 2),
        # 3 slots: D evicts C (next at 7, farthest): A, B, A hit.
        ("belady", 3, 3),
        # pinned (lru_slots=1): A (3 requests) and B (2, ties C to the lower key) pinned.
        ("pinned", 3, 3),
    ],
)
def test_hand_computed_hits_on_a_small_log(policy, slots, hits):
    fn = {"lru": sim.lru, "belady": sim.belady, "pinned": sim.pinned}[policy]
    r = fn(SMALL, slots)
    assert (r.requests, r.hits, r.misses) == (8, hits, 8 - hits)


def test_pinned_plus_lru_by_hand():
    # 3 slots, 2 for LRU: A pinned (hits at 3, 6); B C D B C through 2 LRU slots never hit.
    r = sim.pinned(SMALL, 3, lru_slots=2)
    assert (r.policy, r.hits) == ("pinned+lru", 2)
    with pytest.raises(ValueError):
        sim.pinned(SMALL, 3, lru_slots=0)


def test_cyclic_pattern_over_more_keys_than_slots_gives_zero_lru_hits():
    n = 12
    ids = list(range(n)) * 5
    for slots in (1, n // 2, n - 1):
        assert sim.lru(ids, slots).hits == 0
        assert sim.belady(ids, slots).hits > 0 if slots > 1 else True
    assert sim.lru(ids, n).hits == 4 * n
    # The same as a model's route log: 4 layers x 3 experts per pass, 12 distinct keys.
    log = np.array([(la, e) for _ in range(5) for la in range(4) for e in range(3)])
    (res,) = sim.simulate(log, [11], ["lru"], hints="none")
    assert res.hits == 0 and res.misses == 60


def random_log(rng, passes=30, layers=4, experts=10, k=3, skew=0.0, chunk=1):
    """A model-like log: per pass, per layer, the union of `chunk` tokens' top-k, ascending."""
    p = 1.0 / np.arange(1, experts + 1) ** skew
    p /= p.sum()
    rows = []
    for _ in range(passes):
        for la in range(layers):
            chosen = set()
            for _ in range(chunk):
                chosen |= set(rng.choice(experts, k, replace=False, p=p).tolist())
            rows += [(la, e) for e in sorted(chosen)]
    return np.array(rows, dtype=np.int64)


def test_belady_is_never_below_any_other_policy():
    rng = np.random.default_rng(1)
    for trial in range(25):
        log = random_log(rng, passes=20, skew=trial % 3 * 0.7, chunk=1 + trial % 3)
        ids = sim.key_ids(log).tolist()
        for slots in (1, 2, 5, 9, 13, 20, 40):
            best = sim.belady(ids, slots).hits
            assert best >= sim.lru(ids, slots).hits
            assert best >= sim.pinned(ids, slots).hits
            assert best >= sim.pinned(ids, slots, lru_slots=max(1, slots // 2)).hits
            assert best >= sim.replay_store(log, slots, hash_layers=1).hits
        # More slots never hurt the optimum.
        assert [sim.belady(ids, s).hits for s in range(1, 42, 5)] == sorted(
            sim.belady(ids, s).hits for s in range(1, 42, 5)
        )


def test_belady_counts_match_a_brute_force_optimum_on_tiny_logs():
    """Exhaustive search over every eviction choice equals the heap implementation."""

    def best(ids, slots, i=0, cache=frozenset()):
        if i == len(ids):
            return 0
        k = ids[i]
        if k in cache:
            return 1 + best(ids, slots, i + 1, cache)
        if len(cache) < slots:
            return best(ids, slots, i + 1, cache | {k})
        return max(best(ids, slots, i + 1, (cache - {v}) | {k}) for v in cache)

    rnd = random.Random(3)
    for _ in range(30):
        ids = [rnd.randrange(5) for _ in range(9)]
        for slots in (1, 2, 3):
            assert sim.belady(ids, slots).hits == best(ids, slots)


def test_frequency_pinning_beats_lru_on_skewed_routing_below_the_working_set():
    rng = np.random.default_rng(2)
    log = random_log(rng, passes=200, layers=4, experts=16, k=4, skew=1.2)
    ids = sim.key_ids(log).tolist()
    slots = 12  # the working set is 16 experts per pass
    lru_hits = sim.lru(ids, slots).hits
    pin_hits = sim.pinned(ids, slots).hits
    assert pin_hits > 2 * lru_hits and pin_hits > 0.2 * len(ids)
    # Uniform routing leaves pinning little to work with.
    flat = sim.key_ids(random_log(rng, passes=200, layers=4, experts=16, k=4, skew=0.0)).tolist()
    assert sim.pinned(flat, slots).hit_rate < 0.5 * sim.pinned(ids, slots).hit_rate


def test_bytes_read_are_misses_times_expert_bytes():
    r = sim.lru(SMALL, 3, expert_bytes=1000)
    assert r.bytes_read == 6000 and r.as_dict()["hit_rate"] == pytest.approx(0.25)


def test_engine_calls_follow_the_engine_prefetch_pattern():
    # Two passes over 3 layers, layer 0 hash-routed: hash keys prefetched up front,
    # scored layers prefetched just before their get_many; "previous" replays one get each.
    log = np.array([(0, 1), (0, 4), (1, 2), (2, 0), (2, 3), (0, 2), (1, 2), (1, 5), (2, 3)])
    assert list(sim.engine_calls(log, hash_layers=1)) == [
        ("prefetch", [(0, 1), (0, 4)]), ("get_many", [(0, 1), (0, 4)]),
        ("prefetch", [(1, 2)]), ("get_many", [(1, 2)]),
        ("prefetch", [(2, 0), (2, 3)]), ("get_many", [(2, 0), (2, 3)]),
        ("prefetch", [(0, 2)]), ("get_many", [(0, 2)]),
        ("prefetch", [(1, 2), (1, 5)]), ("get_many", [(1, 2), (1, 5)]),
        ("prefetch", [(2, 3)]), ("get_many", [(2, 3)]),
    ]  # fmt: skip
    calls = [c for c in sim.engine_calls(log, hash_layers=1, release="previous") if c[0] != "release"]
    assert calls == [
        ("prefetch", [(0, 1), (0, 4)]), ("get", (0, 1)), ("get", (0, 4)),
        ("prefetch", [(1, 2)]), ("get", (1, 2)),
        ("prefetch", [(2, 0), (2, 3)]), ("get", (2, 0)), ("get", (2, 3)),
        ("prefetch", [(0, 2)]), ("get", (0, 2)),
        ("prefetch", [(1, 2), (1, 5)]), ("get", (1, 2)), ("get", (1, 5)),
        ("prefetch", [(2, 3)]), ("get", (2, 3)),
    ]  # fmt: skip
    assert sim.forward_passes(log) == 2 and sim.distinct(log) == 7
    assert sim.max_prefetch(log, 1) == 2 and sim.max_prefetch(log, 3) == 5


# ---- the simulator against the real store ------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory.mktemp("sim"), layers=3, experts=8)


def drive(store_or_model, calls):
    for op, arg in calls:
        out = getattr(store_or_model, op)(*(() if arg is None else (arg,)))
        if op == "get_many" and out is not None:  # the store's is a generator: consume it, with work
            for _ in out:
                time.sleep(random.random() * 1e-4)  # reads land while the consumer works


COUNTERS = ("requests", "hits", "misses", "evictions", "prefetches", "prefetch_used", "prefetch_unused")


def test_store_model_counters_equal_the_store_on_random_calls(files):
    layouts, _ = files
    keys = sorted(layouts)
    rnd = random.Random(11)
    for slots in (2, 3, 5, 9):
        calls, pinned = [], []
        for _ in range(250):
            x = rnd.random()
            if x < 0.55:
                k = rnd.choice(keys)
                calls.append(("get", k))
                pinned.append(k)
                while len(pinned) >= slots - 1:  # keep one slot free of pins, or get would raise
                    calls.append(("release", pinned.pop(0)))
            elif x < 0.85:
                calls.append(("prefetch", rnd.sample(keys, rnd.randrange(1, 6))))
            elif pinned:
                calls.append(("release", pinned.pop(rnd.randrange(len(pinned)))))
        model = sim.StoreModel(slots)
        drive(model, calls)
        with ExpertStore(layouts, slots=slots, threads=3, **QUIET) as store:
            drive(store, calls)
            s = store.stats()
        assert [getattr(model.counts, c) for c in COUNTERS] == [getattr(s, c) for c in COUNTERS], slots


def test_store_model_refuses_like_the_store_when_every_slot_is_pinned():
    m = sim.StoreModel(2)
    m.get("a")
    m.get("b")
    m.prefetch(["c"])  # a hint: nothing evictable, nothing happens
    assert m.counts.prefetches == 0
    with pytest.raises(BudgetError):
        m.get("c")


@pytest.mark.parametrize("release", sim.RELEASES)
def test_replay_of_the_store_route_log_reproduces_its_hit_count_exactly(files, release):
    """Drive the real store the way the engine does, from a cold cache, with its route log on;
    replaying that log must give the store's own counters, at sizes below and above every
    prefetch."""
    layouts, _ = files
    rng = np.random.default_rng(5)
    # Decode passes (2 experts per layer) and prefill chunks (up to 8 distinct per layer).
    log = np.concatenate([random_log(rng, passes=6, layers=3, experts=8, k=2, skew=1.0, chunk=c) for c in (1, 4, 1)])
    cyclic = np.array([(la, e) for _ in range(5) for la in range(3) for e in range(4)])  # 12 keys
    log = np.concatenate([log, cyclic]) if release == "previous" else log
    big = sim.max_prefetch(log, 1)
    for slots in (3, 4, 6, big - 1, big, big + 1, 11, 17, 24):
        buf = io.StringIO()
        with ExpertStore(layouts, slots=slots, threads=2, route_log=buf, **QUIET) as store:
            drive(store, sim.engine_calls(log, hash_layers=1, release=release))
            s = store.stats()
        written = buf.getvalue()
        path_log = np.array([ln.split() for ln in written.splitlines()], dtype=np.int64)
        assert np.array_equal(path_log, log)
        r = sim.replay_store(path_log, slots, hash_layers=1, release=release)
        assert (r.requests, r.hits, r.misses) == (s.requests, s.hits, s.misses), slots
        model = sim.run_calls(sim.engine_calls(log, 1, release), slots)
        assert [getattr(model.counts, c) for c in COUNTERS] == [getattr(s, c) for c in COUNTERS]


def test_plain_lru_equals_the_store_driven_with_gets_only(files, tmp_path):
    layouts, _ = files
    keys = sorted(layouts)
    rnd = random.Random(4)
    seq = [rnd.choice(keys[:14]) for _ in range(400)]
    path = tmp_path / "route.txt"
    for slots in (1, 4, 7, 13, 20):
        with ExpertStore(layouts, slots=slots, route_log=path, **QUIET) as store:
            for k in seq:
                with store.hold(k):
                    pass
            s = store.stats()
        log = sim.read_route_log(path)
        r = sim.lru(sim.key_ids(log).tolist(), slots)
        assert (r.hits, r.misses, r.requests) == (s.hits, s.misses, s.requests)


def test_read_route_log_rejects_what_is_not_one(tmp_path):
    p = tmp_path / "log.txt"
    p.write_text("0 1\n2 3\n\n")
    assert sim.read_route_log(p).tolist() == [[0, 1], [2, 3]]
    for bad in ("0 1\n2\n", "0 x\n", "1 -2\n"):
        p.write_text(bad)
        with pytest.raises(UsageError, match="not a route log"):
            sim.read_route_log(p)


# ---- the command ---------------------------------------------------------------------------


def test_bench_simulate_command_prints_and_writes(tmp_path):
    rng = np.random.default_rng(0)
    log = random_log(rng, passes=40, layers=4, experts=8, k=2, skew=1.0)
    path = tmp_path / "route.txt"
    path.write_text("".join(f"{la} {e}\n" for la, e in log))
    out_json, out_csv = tmp_path / "s.json", tmp_path / "s.csv"
    res = CliRunner().invoke(
        bench,
        ["simulate", str(path), "--cache-experts", "4,8,16", "--expert-bytes", "1000", "--hash-layers", "3",
         "--json", str(out_json), "--csv", str(out_csv)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    # without a config the hash layers are not guessed
    bare = CliRunner().invoke(bench, ["simulate", str(path), "--cache-experts", "4"])
    assert isinstance(bare.exception, UsageError) and "--hash-layers N" in str(bare.exception)
    assert CliRunner().invoke(bench, ["simulate", str(path), "--cache-experts", "4", "--hints", "none"]).exit_code == 0
    assert "belady" in res.output and "pinned+lru" in res.output and "read GB" in res.output
    data = json.loads(out_json.read_text())
    assert data["requests"] == len(log) and data["passes"] == 40 and len(data["results"]) == 12
    lru16 = next(r for r in data["results"] if r["policy"] == "lru" and r["slots"] == 16)
    assert lru16["hits"] == sim.replay_store(log, 16, hash_layers=3).hits
    assert lru16["bytes_read"] == lru16["misses"] * 1000
    assert out_csv.read_text().splitlines()[0].startswith("policy,slots,requests,hits,misses,bytes_read,hit_rate")


def test_bench_simulate_budgets_use_the_planner(tmp_path):
    from dsv4stream.checkpoint.config import ModelConfig
    from dsv4stream.cli.bench import budget_slots, working_set_budget
    from dsv4stream.run.memory import needs_of
    from dsv4stream.run.planner import GB, plan
    from dsv4stream.synth import release_config

    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(release_config("demo")))
    cfg = ModelConfig.from_json(cfg_path)
    needs, _ = needs_of(cfg_path)  # as the bench plans it: the run's numerics (fast: the int8 head copy)
    ws = working_set_budget(needs)
    assert plan(needs, ws).expert_slots >= cfg.working_set_experts > plan(needs, ws - GB // 100).expert_slots
    rng = np.random.default_rng(0)
    log = random_log(rng, passes=10, layers=cfg.n_layers, experts=cfg.n_routed_experts, k=cfg.num_experts_per_tok)
    path = tmp_path / "route.txt"
    path.write_text("".join(f"{la} {e}\n" for la, e in log))
    gbs = [round(ws / GB - 0.05, 2), round(ws / GB + 0.3, 2)]
    out_json = tmp_path / "s.json"
    args = ["simulate", str(path), "--budgets", ",".join(map(str, gbs)), "--config", str(cfg_path)]
    res = CliRunner().invoke(bench, [*args, "--json", str(out_json), "--policies", "lru"])
    assert res.exit_code == 0, res.output
    rows = json.loads(out_json.read_text())["results"]
    assert [r["slots"] for r in rows] == [budget_slots(needs, g) for g in gbs]
    assert rows[0]["slots"] < cfg.working_set_experts <= rows[1]["slots"]
    assert rows[0]["hits"] == 0 and rows[1]["hits"] > 0
    assert rows[0]["bytes_read"] == rows[0]["misses"] * cfg.expert_bytes
    assert "working set" in res.output
    bad = CliRunner().invoke(bench, ["simulate", str(path), "--budgets", "1"])
    assert isinstance(bad.exception, UsageError) and "--config" in str(bad.exception)


def test_bench_group_sends_a_checkpoint_path_to_the_live_sweep(tmp_path, monkeypatch):
    from dsv4stream.measure import sweep
    from dsv4stream.synth import release_config

    seen = {}
    monkeypatch.setattr(sweep, "sweep", lambda ckpt, gbs, *a, **k: seen.update(ckpt=ckpt, gbs=gbs) or 1 / 0)
    (tmp_path / "config.json").write_text(json.dumps(release_config("tiny")))
    res = CliRunner().invoke(bench, [str(tmp_path), "--budgets", "1,2"])
    assert isinstance(res.exception, ZeroDivisionError) and seen == {"ckpt": tmp_path, "gbs": [1.0, 2.0]}


def test_prefetch_hints_can_make_the_store_differ_from_plain_lru(files):
    """Why replay_store models the prefetch hints: a prefetch touches its present keys first
    and never evicts its own keys nor an unrequested prefetch, so the store's counts can
    leave plain LRU's."""
    layouts, _ = files
    rng = np.random.default_rng(0)
    for _ in range(100):
        log = np.concatenate(
            [random_log(rng, passes=8, layers=3, experts=8, k=2, skew=1.0, chunk=c) for c in (1, 4, 1)]
        )
        ids = sim.key_ids(log).tolist()
        for slots in range(2, sim.max_prefetch(log, 1) + 3):
            plain = sim.lru(ids, slots).hits
            if sim.replay_store(log, slots, hash_layers=1).hits == plain:
                continue
            with ExpertStore(layouts, slots=slots, threads=2, **QUIET) as store:
                drive(store, sim.engine_calls(log, hash_layers=1))
                assert store.stats().hits == sim.replay_store(log, slots, hash_layers=1).hits != plain
            return
    pytest.fail("no log where the prefetch hints change LRU's counts")


def test_replay_reproduces_a_real_engine_run_exactly(tmp_path):
    """The engine's own calls (prefetch hints included) through the live provider and store, on a generated
    checkpoint with skewed routing: its route log replays to the store's hits at every size."""
    from dsv4stream.checkpoint.catalog import Catalog
    from dsv4stream.engine.session import Engine
    from dsv4stream.streaming.expert_layout import expert_layouts
    from dsv4stream.streaming.experts import StreamedExperts
    from dsv4stream.synth import make_checkpoint

    ck = make_checkpoint(tmp_path / "c", "tiny", seed=1, route_skew=0.7, n_routed_experts=16, num_experts_per_tok=3,
                         num_hash_layers=2)  # fmt: skip
    cat = Catalog.open(ck)
    cfg, layouts = cat.config, expert_layouts(cat.entries, cat.config.n_layers)
    trunk = Engine.open(ck).trunk

    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 20).tolist()
    outs = set()
    for slots in (3, 6, 10, 12, 24):
        buf = io.StringIO()
        with ExpertStore(
            layouts.layouts, slots=slots, io="buffered", route_log=buf, order=layouts.order, **QUIET
        ) as st:
            outs.add(tuple(Engine(cfg, trunk, StreamedExperts(st, cfg), cat).session(chunk_size=8).generate(prompt, 4)))
            s = st.stats()
        log = np.array([ln.split() for ln in buf.getvalue().splitlines()], dtype=np.int64)
        assert sim.replay_store(log, slots, hash_layers=2).hits == s.hits and len(log) == s.requests
    assert len(outs) == 1
