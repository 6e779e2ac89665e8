"""ExpertStore: verified reads, injected placement bugs, LRU counters, pins, stress, errors."""

import errno
import io
import os
import random
import threading
import time

import numpy as np
import pytest
from store_files import make_files

from dsv4stream.errors import BudgetError, InternalError, ReadError, StoreError, VerifyError
from dsv4stream.store import ExpertStore, directio
from dsv4stream.store.directio import ALIGN, SlotPlan, Window
from dsv4stream.store.runs import layout_pieces
from dsv4stream.streaming.expert_layout import expert_label

QUIET = {"warn": lambda m: None}
GOOD_PLAN = directio.plan_slot


@pytest.fixture
def files(tmp_path):
    return make_files(tmp_path)


def assert_item(layouts, truth, key, views):
    pieces = layout_pieces(layouts[key])
    assert len(views) == len(pieces)
    for p, v in zip(pieces, views, strict=True):
        assert v.dtype == p.dtype and v.shape == p.shape
        assert v.tobytes() == truth[p.name], f"{key} {p.name}"


def test_every_read_verified_and_views_are_zero_copy(files):
    layouts, truth = files
    with ExpertStore(layouts, slots=5, threads=3, verify=True, **QUIET) as store:
        for key in layouts:
            with store.hold(key) as views:
                assert_item(layouts, truth, key, views)
                assert all(v.base is not None and not v.flags.owndata for v in views)
        s = store.stats()
    assert s.misses == len(layouts) == s.verified_reads and s.verify_mismatches == 0
    # Whole pages around each run, except past the end of a file.
    pages = [(r.offset // ALIGN, -(-r.end // ALIGN), os.path.getsize(r.path)) for lay in layouts.values() for r in lay]
    assert s.bytes_read == sum(min(hi * ALIGN, size) - lo * ALIGN for lo, hi, size in pages)
    assert s.read_seconds > 0 and s.read_gbps > 0


def plan_without_residue(layout):
    """The classic bug: pieces placed as if each window began at the run's first byte."""
    good = GOOD_PLAN(layout)
    offs = [w.slot_offset + (p.offset - run.offset) for w, run in zip(good.windows, layout) for p in run.pieces]
    return SlotPlan(good.windows, tuple(offs), good.nbytes)


def plan_without_room(layout):
    """The other bug: the next window starts after the run's length rounded up, not after
    the previous window, so a window one page longer overwrites the previous run's tail."""
    windows, offs, pos = [], [], 0
    for run in layout:
        start = run.offset // ALIGN * ALIGN
        stop = -(-run.end // ALIGN) * ALIGN
        windows.append(Window(run.path, start, stop - start, pos, run.end - start))
        offs += [pos + p.offset - start for p in run.pieces]
        pos += -(-run.nbytes // ALIGN) * ALIGN
    return SlotPlan(tuple(windows), tuple(offs), max(w.slot_offset + w.nbytes for w in windows))


@pytest.mark.parametrize("bad_plan", [plan_without_residue, plan_without_room])
def test_wrong_placement_is_caught_by_the_verifier(files, monkeypatch, bad_plan):
    layouts, truth = files
    monkeypatch.setattr(directio, "plan_slot", bad_plan)
    # Without the verifier the bug goes unnoticed: the views just hold wrong bytes.
    with ExpertStore(layouts, slots=2, verify=False, **QUIET) as store:
        wrong = 0
        for key in layouts:
            with store.hold(key) as views:
                wrong += any(v.tobytes() != truth[p.name] for p, v in zip(layout_pieces(layouts[key]), views))
        assert wrong > 0
    with ExpertStore(layouts, slots=2, verify=True, label=expert_label, **QUIET) as store:
        with pytest.raises(VerifyError) as err:
            for key in layouts:
                with store.hold(key):
                    pass
        msg = str(err.value)
        assert msg.startswith("layer ") and " expert " in msg and "tensor layers." in msg
        assert "shard-" in msg and "at offset " in msg
        assert store.stats().verify_mismatches == 1


def run_sequence(layouts, slots, ops, threads=2, route_log=None):
    keys = sorted(layouts)
    with ExpertStore(layouts, slots=slots, threads=threads, route_log=route_log, **QUIET) as store:
        for op, idx in ops:
            if op == "get":
                store.get(keys[idx])
                store.release(keys[idx])
            else:
                store.prefetch([keys[i] for i in idx])
    return store.stats()  # closed: every read it started has finished


def test_lru_counters_exact_on_a_hand_built_sequence(files):
    layouts, _ = files
    # slots=3; keys 0..4; LRU oldest-first after each step, * = prefetched, not yet requested.
    ops = [
        ("get", 0),  # miss            [0]
        ("get", 1),  # miss            [0 1]
        ("get", 0),  # hit             [1 0]
        ("get", 2),  # miss            [1 0 2]
        ("get", 3),  # miss, evict 1   [0 2 3]
        ("get", 1),  # miss, evict 0   [2 3 1]
        ("get", 2),  # hit             [3 1 2]
        ("get", 3),  # hit             [1 2 3]
        ("pre", [4, 2]),  # 4 evicts 1; 2 becomes newest: [3 4* 2]
        ("get", 0),  # miss, evicts 3 (2 was protected by the prefetch touch): [4* 2 0]
        ("get", 2),  # hit             [4* 0 2]
        ("get", 4),  # miss (its read was prefetched)  [0 2 4]
        ("get", 4),  # hit
        ("pre", [0, 1]),  # 0 becomes newest, 1 evicts 2: [4 0 1*]
        ("get", 1),  # miss (prefetched)  [4 0 1]
        ("pre", [2, 3]),  # 2 evicts 4, 3 evicts 0: [1 2* 3*]
        ("pre", [4]),  # evicts 1 (a prefetch never evicts another unrequested one): [2* 3* 4*]
        ("pre", [0]),  # only unrequested prefetches left: a hint, so nothing happens
        ("get", 0),  # miss; a request may evict the unrequested 2*: [3* 4* 0]
    ]
    s = run_sequence(layouts, 3, ops)
    assert (s.requests, s.hits, s.misses, s.evictions) == (14, 5, 9, 9)
    assert (s.prefetches, s.prefetch_used, s.prefetch_unused) == (5, 2, 1)


def test_cyclic_access_over_more_keys_than_slots_never_hits(files):
    layouts, _ = files
    n = len(layouts)
    ops = [("get", i % n) for i in range(3 * n)]
    s = run_sequence(layouts, n - 1, ops)
    assert s.hits == 0 and s.misses == 3 * n and s.evictions == 3 * n - (n - 1)
    s = run_sequence(layouts, n, ops)
    assert s.hits == 2 * n and s.misses == n and s.evictions == 0


def test_counters_and_route_log_do_not_depend_on_thread_count(files, monkeypatch):
    layouts, _ = files
    rng = random.Random(7)
    ops = [("get", rng.randrange(len(layouts))) if rng.random() < 0.7 else ("pre", rng.sample(range(24), 4))
           for _ in range(300)]  # fmt: skip
    # End on a prefetch of 4 keys none of the last accesses touched (so absent) that read
    # slowly, then a miss that reads fast: one reader thread finishes them before the miss,
    # eight are still reading them when the sequence ends. bytes_read counts finished reads,
    # so the counters compared are the closed store's (close waits for every read).
    recent = {k for _, x in ops[-12:] for k in (x if isinstance(x, list) else [x])}
    late = [k for k in range(len(layouts)) if k not in recent][:5]
    ops += [("pre", late[:4]), ("get", late[4])]
    keys = sorted(layouts)
    slow = {(w.path, w.file_offset) for k in late[:4] for w in GOOD_PLAN(layouts[keys[k]]).windows}
    read = directio.FileSet.read
    monkeypatch.setattr(
        directio.FileSet,
        "read",
        lambda self, w, s: (time.sleep(0.05 * ((w.path, w.file_offset) in slow)), read(self, w, s))[1],
    )
    logs, stats = [], []
    for threads in (1, 8):
        buf = io.StringIO()
        stats.append(run_sequence(layouts, 5, ops, threads=threads, route_log=buf))
        logs.append(buf.getvalue())
    keep = ("requests", "hits", "misses", "evictions", "prefetches", "prefetch_used", "prefetch_unused", "bytes_read")
    assert [getattr(stats[0], k) for k in keep] == [getattr(stats[1], k) for k in keep]
    assert logs[0] == logs[1] and logs[0].count("\n") == stats[0].requests


def test_route_log_file_has_one_layer_expert_line_per_request(files, tmp_path):
    layouts, _ = files
    path = tmp_path / "route.txt"
    with ExpertStore(layouts, slots=2, route_log=path, **QUIET) as store:
        for key in [(0, 1), (2, 7), (0, 1)]:
            with store.hold(key):
                pass
        for _ in store.get_many([(1, 3), (0, 1)]):
            pass
    assert path.read_text() == "0 1\n2 7\n0 1\n1 3\n0 1\n"


def test_pinned_slots_are_never_evicted(files):
    layouts, truth = files
    a, b, c = (0, 0), (0, 1), (0, 2)
    with ExpertStore(layouts, slots=2, **QUIET) as store:
        va = store.get(a)
        store.get(b)
        store.prefetch([c])  # a hint: nothing evictable, so nothing happens
        with pytest.raises(BudgetError, match="all 2 expert slots are pinned"):
            store.get(c)
        store.release(b)
        assert_item(layouts, truth, c, store.get(c))  # evicts b, not the pinned a
        assert_item(layouts, truth, a, va)
        with pytest.raises(InternalError, match="without a matching get"):
            store.release(b)
        store.release(a)
        store.release(c)
        assert store.stats().evictions == 1


def test_get_many_yields_present_first_then_misses_and_releases(files):
    layouts, truth = files
    keys = [(1, 0), (1, 1), (1, 2), (1, 3)]
    with ExpertStore(layouts, slots=4, **QUIET) as store:
        for k in (keys[3], keys[1]):
            with store.hold(k):
                pass
        seen = []
        for key, views in store.get_many(keys):
            assert_item(layouts, truth, key, views)
            seen.append(key)
        assert seen[:2] == [keys[1], keys[3]] and sorted(seen[2:]) == [keys[0], keys[2]]  # misses as they land
        s = store.stats()
        assert (s.requests, s.hits, s.misses) == (6, 2, 4)
        gen = store.get_many(keys)
        next(gen)
        gen.close()  # early exit releases every pin it took
        assert store._lru.pinned() == 0


def test_concurrent_loads_under_stress_never_corrupt_a_pinned_slot(tmp_path):
    layouts, truth = make_files(tmp_path, layers=4, experts=10, files=3)
    keys = sorted(layouts)
    errors = []
    with ExpertStore(layouts, slots=7, threads=4, verify=True, **QUIET) as store:

        def worker(seed):
            rng = random.Random(seed)
            try:
                for _ in range(150):
                    if rng.random() < 0.3:
                        store.prefetch(rng.sample(keys, 3))
                    key = rng.choice(keys)
                    views = store.get(key)  # 6 threads pin at most 6 of the 7 slots
                    try:
                        assert_item(layouts, truth, key, views)
                        time.sleep(rng.random() * 1e-4)  # let other loads land meanwhile
                        assert_item(layouts, truth, key, views)
                    finally:
                        store.release(key)
            except Exception as e:  # noqa: BLE001 (collected, re-raised below)
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s = store.stats()
    assert not errors, errors[0]
    assert s.verify_mismatches == 0 and s.verified_reads == s.misses + s.prefetches - s.prefetch_used
    assert s.hits + s.misses == s.requests > 0


def test_read_errors_reach_the_caller_with_the_key(tmp_path):
    layouts, _ = make_files(tmp_path, files=1)
    os.truncate(tmp_path / "shard-0.safetensors", 300_000)  # weights region gone
    with ExpertStore(layouts, slots=2, label=expert_label, **QUIET) as store:
        store.prefetch([(0, 1)])
        for _ in range(2):  # a failed load is dropped, so asking again reads again
            with pytest.raises(ReadError, match=r"^layer 0 expert 1: short read: .*shard-0\.safetensors at offset \d+"):
                store.get((0, 1))
        assert store.stats().misses == 2
        with pytest.raises(StoreError, match=r"no layout for key \(9, 9\)"):
            store.get((9, 9))
    with pytest.raises(StoreError, match="closed"):
        store.get((0, 1))


def test_wait_seconds_counts_only_blocked_time(files, monkeypatch):
    layouts, _ = files
    real = directio.FileSet.read

    def slow_read(self, window, slot):
        time.sleep(0.02)
        return real(self, window, slot)

    monkeypatch.setattr(directio.FileSet, "read", slow_read)
    with ExpertStore(layouts, slots=4, threads=2, **QUIET) as store:
        store.get((0, 0))
        blocked = store.stats().wait_seconds
        before = store.stats().bytes_read
        store.prefetch([(0, 1)])
        deadline = time.perf_counter() + 10
        while store.stats().bytes_read == before and time.perf_counter() < deadline:
            time.sleep(0.01)  # "compute" until the read has landed
        store.get((0, 1))
        s = store.stats()
    # the two runs of (0, 0) may be read side by side on the two threads: at least one 0.02 s
    assert blocked >= 0.018 and s.wait_seconds - blocked < 0.01
    assert s.read_seconds >= 0.07
    assert np.isfinite(s.read_gbps)


def test_a_bug_in_a_reader_thread_keeps_its_type_and_traceback(files, monkeypatch):
    layouts, _ = files

    def broken(buf, layout, plan):
        raise ZeroDivisionError("a bug in the placement code")

    monkeypatch.setattr(directio, "piece_views", broken)
    store = ExpertStore(layouts, slots=2, label=expert_label, **QUIET)
    with store, pytest.raises(ZeroDivisionError, match="a bug in the placement code") as err:
        store.get((0, 1))
    frames = [f.name for f in err.traceback]
    assert "broken" in frames and "_load" in frames  # the reader thread's frames are kept


def test_an_os_error_in_a_reader_thread_is_one_line_naming_the_file(files, monkeypatch):
    layouts, _ = files

    def eio(self, window, slot):
        raise OSError(errno.EIO, "Input/output error", window.path)

    monkeypatch.setattr(directio.FileSet, "read", eio)
    store = ExpertStore(layouts, slots=2, label=expert_label, **QUIET)
    with store, pytest.raises(ReadError, match=r"^layer 0 expert 1: .*shard-\d\.safetensors Input/output error") as err:
        store.get((0, 1))
    assert "\n" not in str(err.value)


def test_lent_slots_leave_the_cache_and_their_pages_come_back_empty(files):
    """`lend` takes free slots first, then the least recently used entries; what stays is the
    most recent; the lent slots' pages are handed back (they read as zeros); get_many pins no
    more than the slots left; giving the slots back makes them free again, lowest first."""
    layouts, truth = files
    keys = list(layouts)
    with ExpertStore(layouts, slots=5, threads=2, **QUIET) as store:
        for k in keys[:4]:  # slots 0-3 hold keys 0-3 (0 oldest), slot 4 free
            with store.hold(k):
                pass
        store._buf[:] = 0xAB  # a marker in every slot, held ones included
        store.lend(2)  # the free slot 4, then slot 0 (key 0, the oldest)
        assert store.lent == 2 and store.resident() == keys[1:4]
        assert not store._buf[4 * store.slot_bytes :].any() and not store._slot(0).any()
        assert (store._buf[store.slot_bytes : 4 * store.slot_bytes] == 0xAB).all()  # the others untouched
        s = store.stats()
        assert (s.misses, s.evictions) == (4, 1)
        for got, views in store.get_many(keys[4:8]):  # three slots: never more pinned at once
            assert_item(layouts, truth, got, views)
            assert store._lru.pinned() <= 3
        assert len(store.resident()) == 3
        store.lend(0)
        assert store.lent == 0
        for k in keys[8:10]:  # the lent slots are free again: no eviction
            with store.hold(k):
                pass
        assert store.stats().evictions == s.evictions + 4 and len(store.resident()) == 5


def test_lending_a_pinned_slot_is_a_bug_and_lending_all_is_refused(files):
    layouts, _ = files
    keys = list(layouts)
    with ExpertStore(layouts, slots=2, threads=1, **QUIET) as store:
        with store.hold(keys[0]), store.hold(keys[1]), pytest.raises(InternalError, match="pinned"):
            store.lend(1)
        with pytest.raises(StoreError, match="lends 0 to 1"):
            store.lend(2)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_populate_faults_the_free_slots_in_ahead_and_never_a_lent_one(files):
    """The slots' pages are touched ahead of the reads (a page's first touch costs more than a
    read into it), on the store's own thread; a lent slot stays out of the resident set."""
    layouts, truth = files
    keys = list(layouts)
    with ExpertStore(layouts, slots=3000, threads=1, **QUIET) as store:
        size = 3000 * store.slot_bytes
        store.lend(1000)  # free slots first: the lowest 1000
        before = _rss()
        store.populate()
        store.wait_populated()
        grown = _rss() - before
        assert 0.9 * 2 / 3 * size < grown < 1.1 * 2 / 3 * size  # the 2000 slots not lent, only
        assert not store._buf[: 1000 * store.slot_bytes].any()
        with store.hold(keys[0]) as views:  # reads land in faulted slots as before
            assert_item(layouts, truth, keys[0], views)


def test_get_groups_hands_what_is_in_memory_as_one_group_counted_as_get_many(files):
    layouts, truth = files
    keys = [(1, 0), (1, 1), (1, 2), (1, 3)]
    counts = []
    for many in ("get_groups", "get_many"):
        with ExpertStore(layouts, slots=4, **QUIET) as store:
            for k in keys[:3]:
                with store.hold(k):
                    pass
            if many == "get_groups":
                groups = list(_held_groups(store, keys[:3], layouts, truth))
                assert groups == [[keys[0], keys[1], keys[2]]]  # all in memory: one group, all pinned
                # a miss: the present ones first, the miss in a later group (or in the same, had it landed)
                groups = list(_held_groups(store, [keys[3], keys[1]], layouts, truth))
                assert groups[0][0] == keys[1] and sorted(k for g in groups for k in g) == [keys[1], keys[3]]
            else:
                for seq in (keys[:3], [keys[3], keys[1]]):
                    for key, views in store.get_many(seq):
                        assert_item(layouts, truth, key, views)
            assert store._lru.pinned() == 0
            s = store.stats()
            counts.append((s.requests, s.hits, s.misses, s.evictions))
    assert counts[0] == counts[1] == (8, 4, 4, 0)


def _held_groups(store, keys, layouts, truth):
    """store.get_groups(keys) as lists of keys, checking every item of a group while it is held."""
    for group in store.get_groups(keys):
        for key, views in group:
            assert_item(layouts, truth, key, views)
        yield [key for key, _ in group]


def test_get_groups_never_pins_more_than_the_free_slots(files):
    """Six keys, one slot held by someone else: cap = slots - 1 unpinned slots; a group holds at
    most half of them, so the next reads go on while one is computed."""
    layouts, truth = files
    keys = [(2, e) for e in range(6)]
    for slots in (3, 5):
        with ExpertStore(layouts, slots=slots, **QUIET) as store:
            held = store.get((0, 0))
            seen = []
            for group in store.get_groups(keys):
                assert 1 <= len(group) <= (slots - 1) // 2 and store._lru.pinned() <= slots
                for key, views in group:
                    assert_item(layouts, truth, key, views)
                    seen.append(key)
            assert sorted(seen) == keys
            assert_item(layouts, truth, (0, 0), held)
            store.release((0, 0))
            assert store._lru.pinned() == 0


def test_a_streamed_expert_that_fails_verification_raises_through_get_groups(files, monkeypatch):
    layouts, _ = files
    monkeypatch.setattr(directio, "plan_slot", plan_without_residue)
    with ExpertStore(layouts, slots=3, verify=True, label=expert_label, **QUIET) as store:
        with pytest.raises(VerifyError, match=r"^layer 1 expert"):
            for _ in store.get_groups([(1, 0), (1, 1), (1, 2)]):
                pass
        assert store._lru.pinned() == 0 and store.stats().verify_mismatches >= 1


def test_slot_lru_pinned_count_equals_a_scan_through_random_operations():
    """`SlotLru.pinned()` is a running count (no scan per call): after every acquire, release,
    unpin, prefetch, drop (a failed read, also while pinned) and eviction it equals the scan."""
    from dsv4stream.store.lru import SlotLru

    rng = random.Random(7)
    lru = SlotLru(6)
    held = []  # entries acquired and not yet given back
    for _ in range(3000):
        op = rng.random()
        if op < 0.4 and len(held) < 5:
            entry, _, _ = lru.acquire(rng.randrange(12))
            held.append(entry)
        elif op < 0.6 and held:
            entry = held.pop(rng.randrange(len(held)))
            if lru.entries.get(entry.key) is entry and rng.random() < 0.5:
                lru.release(entry.key)
            else:
                lru.unpin(entry)
        elif op < 0.7 and held:
            lru.drop(held[rng.randrange(len(held))])  # stays held: its unpin comes later
        elif op < 0.85:
            lru.prefetch([rng.randrange(12) for _ in range(3)])
        assert lru.pinned() == sum(1 for e in lru.entries.values() if e.pins)
    for entry in held:
        lru.unpin(entry)
    assert lru.pinned() == 0
