"""RowCache: rows and their far-apart scales byte-exact, coalesced aligned reads, LRU counters,
determinism, batches and read-ahead limits, errors, the verifier."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from store_files import make_row_files, o_direct_refusal

from dsv4stream.checkpoint.catalog import read_header
from dsv4stream.errors import ReadError, StoreError, VerifyError
from dsv4stream.store import directio, rowcache
from dsv4stream.store.directio import ALIGN
from dsv4stream.store.rowcache import ROW_INDEX_BYTES, RowArray, RowCache, RowTable

QUIET = {"warn": lambda m: None}


def tables_of(files):
    out = []
    for path, values, scales in files:
        entries = {e.name: e for e in read_header(Path(path))}
        parts = []
        for name in (values, scales):
            e = entries[name]
            parts.append(RowArray(e.path, name, e.offset, e.shape[0], e.shape[1]))
        out.append(RowTable(f"table {values}", tuple(parts)))
    return out


def truth_of(files):
    """Each table's rows as the safetensors library reads them: values then scales, per row."""
    out = []
    for path, values, scales in files:
        with safe_open(str(path), framework="numpy") as f:
            out.append(np.concatenate([f.get_tensor(values), f.get_tensor(scales)], axis=1))
    return out


@pytest.fixture
def files(tmp_path):
    return make_row_files(tmp_path)


@pytest.fixture
def tables(files):
    return tables_of(files)


@pytest.fixture
def truth(files):
    return truth_of(files)


def test_rows_and_their_scales_match_the_safetensors_library(files, tables, truth):
    rng = np.random.default_rng(1)
    with RowCache(tables, capacity=500, threads=3, verify=True, **QUIET) as cache:
        for _ in range(6):
            t = int(rng.integers(0, 2))
            ids = rng.integers(0, tables[t].rows, 300)
            ids[::7] = ids[0]  # repeats inside one request
            got = cache.gather(t, ids)
            assert got.shape == (300, 264) and got.dtype == np.uint8
            assert np.array_equal(got, truth[t][ids])
        s = cache.stats()
    assert s.verified_rows == s.rows_read > 0 and s.verify_mismatches == 0
    # first and last rows: the windows at the ends of each array
    with RowCache(tables, capacity=8, **QUIET) as cache:
        for t, tab in enumerate(tables):
            ids = [0, tab.rows - 1, 1, tab.rows - 2]
            assert np.array_equal(cache.gather(t, ids), truth[t][ids])


def test_reads_are_aligned_direct_reads_when_the_file_system_allows(tmp_path, tables, truth, monkeypatch):
    refused = o_direct_refusal(tmp_path)
    if refused:
        pytest.skip(refused)
    seen = []
    real = directio.FileSet.read

    def spy(self, window, slot):
        got = real(self, window, slot)  # opens the file first: is_direct is known after
        seen.append((window.file_offset, window.nbytes, slot.ctypes.data % ALIGN, self.is_direct(window.path)))
        return got

    monkeypatch.setattr(directio.FileSet, "read", spy)
    with RowCache(tables, capacity=64, **QUIET) as cache:
        assert np.array_equal(cache.gather(0, [5, 2000, 77]), truth[0][[5, 2000, 77]])
        assert cache.stats().io == "direct" and cache.stats().fallback_files == 0
    assert seen and all(o % ALIGN == 0 and n % ALIGN == 0 and a == 0 and d for o, n, a, d in seen)


def test_rows_sharing_pages_are_read_once_and_neighbours_coalesce(tables, truth):
    values, scales = tables[0].parts
    ids = np.arange(100, 140)  # 40 consecutive rows: 10 KB of values, 320 B of scales
    with RowCache(tables, capacity=64, **QUIET) as cache:
        assert np.array_equal(cache.gather(0, ids), truth[0][ids])
        s = cache.stats()

    def pages(part):
        lo = (part.offset + ids[0] * part.row_bytes) // ALIGN
        hi = -(-(part.offset + (ids[-1] + 1) * part.row_bytes) // ALIGN)
        return hi - lo

    assert s.reads == 2  # one coalesced window per array
    assert s.bytes_read == (pages(values) + pages(scales)) * ALIGN
    assert s.rows_read == 40


def test_windows_never_exceed_max_window(tables, truth, monkeypatch):
    sizes = []
    real = directio.FileSet.read
    monkeypatch.setattr(directio.FileSet, "read", lambda self, w, b: sizes.append(w.nbytes) or real(self, w, b))
    ids = np.arange(0, 3000)
    with RowCache(tables, capacity=3000, max_window=4 * ALIGN, **QUIET) as cache:
        assert np.array_equal(cache.gather(0, ids), truth[0][ids])
    assert max(sizes) <= 4 * ALIGN


def test_counters_are_exact_on_a_hand_built_sequence(tables):
    with RowCache(tables, capacity=4, **QUIET) as cache:
        cache.gather(0, [1, 2, 1])  # 3 requests: 2 misses, a repeat hits
        cache.gather(0, [1, 2])  # 2 hits
        cache.prefetch(0, [3, 4])  # 2 prefetches into the free slots
        cache.gather(0, [3])  # a prefetched row: a miss, prefetch used
        cache.gather(0, [5])  # full: evicts the oldest claimed row (1; 2 and 3 are newer), not 4
        cache.gather(1, [1])  # another table, same row id: a different row; evicts 2
        s = cache.stats()
    assert (s.requests, s.hits, s.misses) == (8, 3, 5)
    assert (s.prefetches, s.prefetch_used, s.prefetch_unused, s.evictions) == (2, 1, 0, 2)
    assert s.rows_read == 6 and s.resident == 4
    assert s.hit_rate == pytest.approx(3 / 8)


def test_lru_keeps_the_recently_used_rows(tables, truth):
    with RowCache(tables, capacity=3, **QUIET) as cache:
        cache.gather(0, [10, 11, 12])
        cache.gather(0, [10])  # 10 is now the newest
        cache.gather(0, [13])  # evicts 11
        before = cache.stats().misses
        cache.gather(0, [10, 12, 13])
        assert cache.stats().misses == before
        cache.gather(0, [11])
        assert cache.stats().misses == before + 1


def test_a_prefetch_never_evicts_rows_fetched_ahead_and_not_yet_asked_for(tables):
    with RowCache(tables, capacity=3, **QUIET) as cache:
        cache.prefetch(0, [1, 2, 3, 4, 5])  # room for 3: stops quietly
        assert cache.stats().prefetches == 3
        cache.prefetch(0, [6])  # nothing it may evict
        assert cache.stats().prefetches == 3 and cache.stats().evictions == 0
        cache.gather(0, [1])
        cache.prefetch(0, [2, 7])  # 2 is present (touched); 7 may evict the claimed row 1 only
        s = cache.stats()
        assert s.prefetches == 4 and s.evictions == 1 and s.prefetch_unused == 0
        cache.gather(0, [8])  # a request may evict an unrequested prefetch when nothing else is left
        assert cache.stats().prefetch_unused == 1


def test_a_request_larger_than_the_cache_is_served_in_batches(tables, truth):
    ids = np.random.default_rng(2).permutation(tables[0].rows)[:700]
    with RowCache(tables, capacity=50, batch_rows=16, **QUIET) as cache:
        got = cache.gather(0, np.concatenate([ids, ids[:30]]))
        s = cache.stats()
    assert np.array_equal(got[:700], truth[0][ids]) and np.array_equal(got[700:], truth[0][ids[:30]])
    assert s.resident == 50 and s.misses == 700 and s.hits == 30 and s.rows_read == 700


def _run_sequence(tables, seed, **kw):
    rng = np.random.default_rng(seed)
    with RowCache(tables, capacity=40, **QUIET, **kw) as cache:
        for _ in range(40):
            t = int(rng.integers(0, 2))
            ids = rng.integers(0, 120, int(rng.integers(1, 30)))
            if rng.random() < 0.4:
                cache.prefetch(t, ids)
            else:
                cache.gather(t, ids)
        s = cache.stats()
        return s, sorted(cache._skeys.tolist())


def test_counters_and_contents_do_not_depend_on_threads_batches_or_read_timing(tables, monkeypatch):
    base = _run_sequence(tables, 3, threads=1, inflight=1)
    slow = directio.FileSet.read
    rng = np.random.default_rng(9)

    def jittery(self, window, slot):
        time.sleep(float(rng.random()) * 0.002)
        return slow(self, window, slot)

    monkeypatch.setattr(directio.FileSet, "read", jittery)
    for kw in ({"threads": 4, "inflight": 3}, {"threads": 2, "batch_rows": 3}):
        s, resident = _run_sequence(tables, 3, **kw)
        fields = ("requests", "hits", "misses", "evictions", "prefetches", "prefetch_used", "prefetch_unused")
        assert [getattr(s, f) for f in fields] == [getattr(base[0], f) for f in fields]
        assert resident == base[1]


class _GatedPool:
    """A one-thread pool whose tasks wait for `gate`; records what was submitted."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(1)
        self.gate = threading.Event()
        self.submitted = 0

    def submit(self, fn, *args):
        self.submitted += 1
        return self.pool.submit(lambda: (self.gate.wait(), fn(*args)))

    def shutdown(self, wait=True):
        self.pool.shutdown(wait=wait)


def test_read_ahead_keeps_at_most_inflight_batches_on_the_pool_in_order(tables, truth, monkeypatch):
    order = []
    real = directio.FileSet.read
    monkeypatch.setattr(directio.FileSet, "read", lambda self, w, b: order.append(w.file_offset) or real(self, w, b))
    pool = _GatedPool()
    # rows far apart: one window (and one task) per row and array
    ids = np.arange(0, 2400, 200)
    with RowCache(tables, capacity=64, pool=pool, batch_rows=4, inflight=1, **QUIET) as cache:
        cache.prefetch(0, ids)
        assert pool.submitted == 1  # one batch of 4 rows on the pool; two wait their turn
        pool.gate.set()
        assert np.array_equal(cache.gather(0, ids), truth[0][ids])
        s = cache.stats()
    pool.shutdown()
    assert s.prefetch_used == 12 and s.misses == 12 and s.rows_read == 12
    values = tables[0].parts[0]
    first = [o for o in order if o < values.offset + values.rows * values.row_bytes]
    assert first == sorted(first)  # batches read in the order they were queued


def test_a_request_for_a_queued_row_starts_its_batch_at_once(tables, truth):
    pool = ThreadPoolExecutor(2)
    with RowCache(tables, capacity=64, pool=pool, batch_rows=2, inflight=1, **QUIET) as cache:
        blocker = threading.Event()
        real = cache._run

        def held(b, task, prefetch):
            if b.bid == 0:
                blocker.wait(10)
            return real(b, task, prefetch)

        cache._run = held
        cache.prefetch(0, [0, 1000, 2000, 2900])  # batch 0 (held) runs, batch 1 waits its turn
        t0 = time.perf_counter()
        assert np.array_equal(cache.gather(0, [2900]), truth[0][[2900]])  # served while batch 0 is held
        assert time.perf_counter() - t0 < 8
        blocker.set()
    pool.shutdown()


def test_a_shared_pool_is_used_and_left_running(tables, truth):
    with ThreadPoolExecutor(2) as pool:
        with RowCache(tables, capacity=16, pool=pool, **QUIET) as cache:
            assert np.array_equal(cache.gather(1, [3, 4]), truth[1][[3, 4]])
        assert pool.submit(lambda: 7).result() == 7


def test_read_errors_reach_the_caller_and_a_retry_reads_afresh(tables, truth, monkeypatch):
    real = directio.FileSet.read
    fail = {"on": True}

    def broken(self, window, slot):
        if fail["on"]:
            raise ReadError(f"read failed: {window.path} at offset {window.file_offset}: EIO; check the disk")
        return real(self, window, slot)

    monkeypatch.setattr(directio.FileSet, "read", broken)
    with RowCache(tables, capacity=8, **QUIET) as cache:
        with pytest.raises(ReadError, match="EIO"):
            cache.gather(0, [1, 2])
        cache.prefetch(0, [3])
        with pytest.raises(ReadError, match="EIO"):
            cache.gather(0, [3])
        fail["on"] = False
        assert np.array_equal(cache.gather(0, [1, 2, 3]), truth[0][[1, 2, 3]])


def test_a_misplaced_row_is_caught_by_the_verifier(tables, monkeypatch):
    def from_first_row(buf, file_offset, offsets, row_bytes):
        # the classic bug: rows placed as if the window began at the first row's byte
        return buf[(offsets - offsets[0])[:, None] + np.arange(row_bytes)]

    monkeypatch.setattr(rowcache, "window_rows", from_first_row)
    with RowCache(tables, capacity=8, verify=True, **QUIET) as cache:
        with pytest.raises(VerifyError, match="bytes differ"):
            cache.gather(0, [100, 101, 102])
        assert cache.stats().verify_mismatches == 1


def test_bad_requests_and_sizes_are_one_line_errors(tables):
    with pytest.raises(StoreError, match="at least 1 row"):
        RowCache(tables, capacity=0)
    with RowCache(tables, capacity=2, **QUIET) as cache:
        with pytest.raises(StoreError, match="row 3001 outside 0..3000") as e:
            cache.gather(0, [3001])
        assert "\n" not in str(e.value)
        with pytest.raises(StoreError, match="no table 2"):
            cache.prefetch(2, [0])
    with pytest.raises(StoreError, match="closed"):
        cache.gather(0, [1])


def test_nbytes_counts_rows_and_their_index(tables):
    assert RowCache.bytes_per_row(tables) == 264 + ROW_INDEX_BYTES
    with RowCache(tables, capacity=10, **QUIET) as cache:
        assert cache.nbytes == 10 * (264 + ROW_INDEX_BYTES)
