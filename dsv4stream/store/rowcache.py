"""RowCache: rows of tables far larger than RAM, read on demand into a budgeted LRU of rows.

Owns the row slots (one buffer of ``capacity`` rows), their LRU bookkeeping, the read batches
and their aligned reads (``directio``'s windows and ``FileSet``), the counters. It knows
nothing about the model: a table is ``RowTable`` (rows of fixed size whose bytes may be split
over several far-apart arrays, e.g. values and their scales), a request names a table and
row ids, and ``gather`` hands back each row's bytes. Decoding the bytes is the caller's job.

Reads
    A batch of rows becomes, per array, one aligned window per row (``[floor(o/A)*A,
    ceil((o+n)/A)*A)``); windows that overlap or touch are coalesced (up to ``max_window``
    bytes), so rows sharing a page cost one page. A read task takes a few windows, reads each
    into its own aligned buffer and scatters the rows' bytes into their slots. At most
    ``inflight`` prefetch batches are on the reader pool at once (each at most ``batch_rows``
    rows), so a long prompt's read-ahead never queues ahead of everything else on a shared
    pool and its staging stays bounded; a demand read goes to the pool at once, and so does a
    queued batch a request is waiting for.

Determinism
    Hits, misses, evictions and which slot a row takes depend only on the sequence of calls
    (``prefetch``/``gather``), never on when reads complete. Each touch gives a row the next
    stamp of a counter (LRU = smallest stamp). A prefetch touches the present ids first, then
    gives each absent id (first occurrence order) a free slot (lowest first) or a victim: the
    least recently used row that a request has already claimed and this call has not touched;
    it never evicts a row fetched ahead and not yet requested, and stops quietly when nothing
    else is left. A request (``gather``) takes the least recently used claimed row, else the
    least recently used unclaimed one, never one of its own current batch. A slot whose read is
    still in flight may change owner: the new read waits for the old one before writing, and a
    queued batch that has not started simply drops the slot.

Counting
    ``gather(table, ids)`` makes ``len(ids)`` requests. The first occurrence of a row in the
    call is a hit when the row was present and claimed by an earlier call; a miss otherwise
    (present but only fetched ahead counts as a miss and ``prefetch_used``: its bytes were read
    for it). Repeats of a row within the call are hits (read once, copied to each place).
    ``rows_read`` counts rows fetched from disk (ahead or on demand), ``bytes_read`` the
    aligned bytes those reads transferred, ``reads`` the read calls (coalesced windows).

Budget
    ``nbytes`` = capacity x (row bytes + ``ROW_INDEX_BYTES``) is what the cache holds at most;
    a request for more distinct rows than the capacity is served in batches that reuse the
    slots (what came before is copied out first), so it never holds more. Reads in flight
    add at most one ``max_window`` buffer per reader thread (``staging_bytes``).

Callers: one thread at a time calls ``prefetch``/``gather`` (the session's); the reader
threads touch only slots the bookkeeping gave to their batch.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Self

import numpy as np

from ..errors import Dsv4Error, InternalError, ReadError, StoreError
from . import directio
from .verify import Part, Verifier

# Bookkeeping per slot: key and stamp (int64 each), claim flag, owning batch (int32), the sorted
# key index (int64 key + int32 slot), the index's copy while it is rebuilt (12 B), and the row's
# entry in a read batch (int64 key + int64 slot): 61, rounded.
ROW_INDEX_BYTES = 64
BATCH_ROWS = 4096  # rows per read batch
INFLIGHT = 2  # prefetch batches on the reader pool at once
MAX_WINDOW = 1 << 20  # largest coalesced read, bytes
TASK_WINDOWS = 64  # windows per read task, at most


@dataclass(frozen=True)
class RowArray:
    """``rows`` rows of ``row_bytes`` each, stored back to back from absolute ``offset`` of
    ``path`` as tensor ``name`` (the verifier finds it again by that name)."""

    path: str
    name: str
    offset: int
    rows: int
    row_bytes: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.rows < 1 or self.row_bytes < 1:
            raise InternalError(f"row array {self.name}: offset {self.offset}, {self.rows} rows of {self.row_bytes} B")


@dataclass(frozen=True)
class RowTable:
    """A table whose row r is the concatenation of row r of every part (values, then scales ...)."""

    label: str
    parts: tuple[RowArray, ...]

    def __post_init__(self) -> None:
        if not self.parts or len({p.rows for p in self.parts}) != 1:
            raise InternalError(f"row table {self.label}: parts must exist and agree on the row count")

    @property
    def rows(self) -> int:
        return self.parts[0].rows

    @property
    def row_bytes(self) -> int:
        return sum(p.row_bytes for p in self.parts)


@dataclass(frozen=True)
class RowStats:
    """Counters since the cache opened (see the module doc for what each counts)."""

    requests: int
    hits: int
    misses: int
    evictions: int
    prefetches: int
    prefetch_used: int
    prefetch_unused: int
    rows_read: int
    reads: int
    bytes_read: int  # aligned bytes transferred from disk
    read_seconds: float  # wall time with at least one read in flight
    wait_seconds: float  # time gather blocked on reads
    verified_rows: int
    verify_mismatches: int
    capacity: int
    resident: int
    row_bytes: int
    io: str
    fallback_files: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0


class _Batch:
    """Rows given slots by one call, read together. ``keys``/``slots`` (int64/int64): a slot
    set to -1 was taken back before the batch started. ``done`` is set when every task ended."""

    __slots__ = ("after", "bid", "done", "error", "keys", "left", "slots", "started")

    def __init__(self, bid: int, keys: np.ndarray, slots: np.ndarray) -> None:
        self.bid = bid
        self.keys = keys
        self.slots = slots
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.after: list[threading.Event] = []
        self.left = 0
        self.started = False


_MAXSTAMP = np.iinfo(np.int64).max


class RowCache:
    """LRU cache of ``capacity`` rows of ``tables`` (see the module doc).

    ``io``: "direct" or "buffered" (``directio.FileSet``). ``pool``: the reader threads to
    share (e.g. the expert store's); None starts ``threads`` of its own. ``verify``: re-read
    every row through ``Verifier`` and raise VerifyError on a difference."""

    def __init__(
        self,
        tables: Sequence[RowTable],
        capacity: int,
        io: str = "direct",
        pool: Executor | None = None,
        threads: int = 4,
        verify: bool = False,
        warn: Callable[[str], None] | None = None,
        batch_rows: int = BATCH_ROWS,
        inflight: int = INFLIGHT,
        max_window: int = MAX_WINDOW,
    ) -> None:
        if capacity < 1:
            raise StoreError(f"a row cache needs room for at least 1 row, got {capacity}")
        if not tables:
            raise InternalError("a row cache needs at least one table")
        if batch_rows < 1 or inflight < 1 or max_window < directio.ALIGN or threads < 1:
            raise InternalError(f"row cache: batch_rows {batch_rows}, inflight {inflight}, max_window {max_window}")
        self.tables = tuple(tables)
        self.capacity = capacity
        self.row_bytes = max(t.row_bytes for t in self.tables)
        self._base = np.cumsum([0] + [t.rows for t in self.tables]).astype(np.int64)
        self._files = directio.FileSet(io, warn)
        self._verifier = Verifier() if verify else None
        self._own_pool = pool is None
        self._pool = pool if pool is not None else ThreadPoolExecutor(threads, thread_name_prefix="dsv4-rows")
        self._batch_rows = batch_rows
        self._inflight = inflight
        self._max_window = max_window
        # slots
        self._data = np.empty((capacity, self.row_bytes), dtype=np.uint8)  # pages touched on first write
        self._key = np.full(capacity, -1, dtype=np.int64)
        self._stamp = np.zeros(capacity, dtype=np.int64)
        self._claimed = np.zeros(capacity, dtype=bool)
        self._owner = np.full(capacity, -1, dtype=np.int32)
        self._fill = 0  # slots below this have been handed out at least once
        self._freed: list[int] = []  # slots given back by failed reads (sorted)
        self._skeys = np.empty(0, dtype=np.int64)  # resident keys, sorted
        self._sslots = np.empty(0, dtype=np.int32)
        self._clock = 0
        self._after: list[threading.Event] = []  # running reads the next batch's slots come from
        # batches
        self._lock = threading.Lock()  # the bookkeeping (one caller thread)
        self._qlock = threading.Lock()  # batches: queue, start, completion
        self._batches: dict[int, _Batch] = {}  # not yet reported: queued, running, or failed
        self._queue: deque[_Batch] = deque()
        self._running = 0  # prefetch batches started and not done
        self._next_bid = 0
        self._closed = False
        # counters
        self._n = dict.fromkeys(
            ("requests", "hits", "misses", "evictions", "prefetches", "prefetch_used", "prefetch_unused"), 0
        )
        self._stat_lock = threading.Lock()
        self._r = dict.fromkeys(("rows_read", "reads", "bytes_read", "verified_rows", "verify_mismatches"), 0)
        self._active = 0
        self._busy_since = 0.0
        self._read_seconds = 0.0
        self._wait_seconds = 0.0

    @staticmethod
    def bytes_per_row(tables: Sequence[RowTable]) -> int:
        """What one cached row of these tables costs (for budget planning)."""
        return RowCache.bytes_per_row_of(max(t.row_bytes for t in tables))

    @staticmethod
    def bytes_per_row_of(row_bytes: int) -> int:
        """What one cached row of ``row_bytes`` costs: the row and its bookkeeping."""
        return row_bytes + ROW_INDEX_BYTES

    @staticmethod
    def staging_bytes(threads: int, max_window: int = MAX_WINDOW) -> int:
        """The aligned read buffers in flight at most: one window per reader thread."""
        return threads * max_window

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds once full (what the budget must cover)."""
        return self.capacity * (self.row_bytes + ROW_INDEX_BYTES)

    @property
    def wait_seconds(self) -> float:
        return self._wait_seconds

    # -- context manager -------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop queued batches, wait for reads in flight, close files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with self._qlock:
                while self._queue:
                    b = self._queue.popleft()
                    b.error = StoreError("the row cache closed before this read started")
                    b.done.set()
                running = [b.done for b in self._batches.values() if b.started]
        for ev in running:
            ev.wait()
        if self._own_pool:
            self._pool.shutdown(wait=True)
        self._files.close()
        if self._verifier is not None:
            self._verifier.close()

    # -- public API ------------------------------------------------------------------

    def prefetch(self, table: int, ids: Sequence[int] | np.ndarray) -> None:
        """Start reading the absent rows of ``ids`` (a hint, not counted as requests): see the
        module doc for which slots it may take; present ids become most recent."""
        keys = self._keys(table, ids)
        if not keys.size:
            return
        with self._lock:
            self._check_open()
            uniq = _first_occurrence(keys)[0]
            slots = self._lookup(uniq)
            present = slots >= 0
            start = self._clock
            self._touch(slots[present])
            absent = uniq[~present]
            taken = self._take(absent.size, start, demand=False)
            if taken.size:
                self._n["prefetches"] += int(taken.size)
                self._assign(absent[: taken.size], taken, claimed=False, queue=True)

    def gather(self, table: int, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The bytes of each row of ``ids`` in order: (len(ids), the table's row bytes) uint8, a copy."""
        keys = self._keys(table, ids)
        out = np.empty((keys.size, self.tables[table].row_bytes), dtype=np.uint8)
        if not keys.size:
            return out
        with self._lock:
            self._check_open()
            uniq, inv = _first_occurrence(keys)
            slots = self._lookup(uniq)
            present = slots >= 0
            p_slots = slots[present]
            claimed = self._claimed[p_slots]
            n = self._n
            n["requests"] += int(keys.size)
            n["hits"] += int(keys.size - uniq.size) + int(claimed.sum())
            n["misses"] += int(uniq.size - claimed.sum())
            n["prefetch_used"] += int((~claimed).sum())
            self._claimed[p_slots] = True
            self._touch(p_slots)
            # present rows first: copied out before any batch below may reuse their slots
            self._wait_rows(p_slots)
            where = np.flatnonzero(present)
            self._copy_out(out, inv, where, p_slots)
            missing = np.flatnonzero(~present)
            # slots are chosen a cache-full at a time (never per read batch: the counters and
            # contents must not depend on batch_rows); the reads go out in batches
            for lo in range(0, missing.size, self.capacity):
                part = missing[lo : lo + self.capacity]
                start = self._clock
                taken = self._take(part.size, start, demand=True)
                if taken.size != part.size:
                    raise InternalError(f"row cache: {part.size} rows asked, {taken.size} slots found")
                for batch in self._assign(uniq[part], taken, claimed=True, queue=False):
                    self._wait_batch(batch)
                self._copy_out(out, inv, part, taken)
        return out

    def stats(self) -> RowStats:
        # not under self._lock: a progress ticker may ask while a request waits on its reads
        with self._stat_lock:
            n = dict(self._n)
            r = dict(self._r)
            seconds = self._read_seconds + (time.perf_counter() - self._busy_since if self._active else 0.0)
            resident = int(self._skeys.size)
        return RowStats(
            **n,
            **{k: r[k] for k in ("rows_read", "reads", "bytes_read")},
            read_seconds=seconds,
            wait_seconds=self._wait_seconds,
            verified_rows=r["verified_rows"],
            verify_mismatches=r["verify_mismatches"],
            capacity=self.capacity,
            resident=resident,
            row_bytes=self.row_bytes,
            io=self._files.io,
            fallback_files=len(self._files.fallback_paths),
        )

    # -- bookkeeping (self._lock held) -------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the row cache is closed")

    def _keys(self, table: int, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        if not 0 <= table < len(self.tables):
            raise StoreError(f"row cache: no table {table} (it has {len(self.tables)})")
        rows = np.asarray(ids, dtype=np.int64).reshape(-1)
        t = self.tables[table]
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= t.rows):
            bad = int(rows[(rows < 0) | (rows >= t.rows)][0])
            raise StoreError(f"{t.label}: row {bad} outside 0..{t.rows - 1}")
        return rows + self._base[table]

    def _lookup(self, keys: np.ndarray) -> np.ndarray:
        """Slot of each key, -1 where absent."""
        pos = np.searchsorted(self._skeys, keys)
        ok = pos < self._skeys.size
        ok[ok] = self._skeys[pos[ok]] == keys[ok]
        out = np.full(keys.size, -1, dtype=np.int64)
        out[ok] = self._sslots[pos[ok]]
        return out

    def _touch(self, slots: np.ndarray) -> None:
        self._stamp[slots] = self._clock + np.arange(slots.size, dtype=np.int64)
        self._clock += int(slots.size)

    def _take(self, k: int, start: int, demand: bool) -> np.ndarray:
        """Up to ``k`` slots, in the order they are handed out (module doc: free lowest first,
        then victims oldest first; none touched since ``start``). Victims leave the index."""
        got: list[np.ndarray] = []
        while k and self._freed:
            got.append(np.array([self._freed.pop(0)], dtype=np.int64))
            k -= 1
        fresh = min(k, self.capacity - self._fill)
        if fresh:
            got.append(np.arange(self._fill, self._fill + fresh, dtype=np.int64))
            self._fill += fresh
            k -= fresh
        if k:
            used = self._key >= 0
            old = used & (self._stamp < start)
            groups = [old & self._claimed]
            if demand:
                groups.append(old & ~self._claimed)
            for mask in groups:
                if not k:
                    break
                cand = np.flatnonzero(mask)
                if cand.size > k:
                    cand = cand[np.argpartition(self._stamp[cand], k - 1)[:k]]
                cand = cand[np.argsort(self._stamp[cand], kind="stable")]
                got.append(cand.astype(np.int64))
                k -= cand.size
        slots = np.concatenate(got) if got else np.empty(0, dtype=np.int64)
        victims = slots[self._key[slots] >= 0]
        if victims.size:
            self._n["evictions"] += int(victims.size)
            self._n["prefetch_unused"] += int((~self._claimed[victims]).sum())
            self._release_owner(victims)
            self._index_remove(self._key[victims])
            self._key[victims] = -1
        return slots

    def _release_owner(self, slots: np.ndarray) -> None:
        """Slots changing owner: a queued batch forgets them; a running one must finish first."""
        owners = self._owner[slots]
        with self._qlock:
            for bid in np.unique(owners[owners >= 0]):
                b = self._batches.get(int(bid))
                if b is None or b.done.is_set():
                    continue
                mine = slots[owners == bid]
                if b.started:
                    self._after.append(b.done)
                else:
                    b.slots[np.isin(b.slots, mine)] = -1

    def _assign(self, keys: np.ndarray, slots: np.ndarray, claimed: bool, queue: bool) -> list[_Batch]:
        """Give ``slots`` to ``keys`` (stamped in order) and start their read: at once, or
        queued in batches of at most ``batch_rows`` rows (prefetch)."""
        self._key[slots] = keys
        self._claimed[slots] = claimed
        self._touch(slots)
        self._index_add(keys, slots)
        after, self._after = self._after, []
        batches = []
        with self._qlock:
            for lo in range(0, keys.size, self._batch_rows):
                b = _Batch(
                    self._next_bid, keys[lo : lo + self._batch_rows].copy(), slots[lo : lo + self._batch_rows].copy()
                )
                b.after = after
                self._next_bid += 1
                self._owner[b.slots] = b.bid
                self._batches[b.bid] = b
                batches.append(b)
                if queue:
                    self._queue.append(b)
                else:
                    self._start(b)
            if queue:
                self._pump()
        return batches

    def _index_remove(self, keys: np.ndarray) -> None:
        pos = np.searchsorted(self._skeys, np.sort(keys))
        self._skeys = np.delete(self._skeys, pos)
        self._sslots = np.delete(self._sslots, pos)

    def _index_add(self, keys: np.ndarray, slots: np.ndarray) -> None:
        o = np.argsort(keys, kind="stable")
        pos = np.searchsorted(self._skeys, keys[o])
        self._skeys = np.insert(self._skeys, pos, keys[o])
        self._sslots = np.insert(self._sslots, pos, slots[o].astype(np.int32))

    def _wait_rows(self, slots: np.ndarray) -> None:
        """Wait for the batches that fill ``slots``; raise the first one's error."""
        owners = np.unique(self._owner[slots])
        for bid in owners[owners >= 0]:
            b = self._batches.get(int(bid))
            if b is not None:
                self._wait_batch(b)

    def _wait_batch(self, b: _Batch) -> None:
        if not b.done.is_set():
            with self._qlock:
                if not b.started and b in self._queue:  # needed now: to the pool ahead of its turn
                    self._queue.remove(b)
                    self._start(b)
            t0 = time.perf_counter()
            b.done.wait()
            with self._stat_lock:
                self._wait_seconds += time.perf_counter() - t0
        with self._qlock:
            self._batches.pop(b.bid, None)
        if b.error is not None:
            # its slots hold garbage: forget their keys so a retry reads afresh
            mine = np.flatnonzero(self._owner == b.bid)
            mine = mine[self._key[mine] >= 0]
            if mine.size:
                self._index_remove(self._key[mine])
                self._key[mine] = -1
                self._owner[mine] = -1
                self._freed = sorted([*self._freed, *(int(s) for s in mine)])
            raise b.error

    def _copy_out(self, out: np.ndarray, inv: np.ndarray, which: np.ndarray, slots: np.ndarray) -> None:
        """Rows ``which`` (indices into the call's distinct keys) live in ``slots``: copy each to
        every place it was asked for."""
        if not which.size:
            return
        slot_of = np.full(int(inv.max()) + 1, -1, dtype=np.int64)
        slot_of[which] = slots
        dest = slot_of[inv]
        sel = np.flatnonzero(dest >= 0)
        out[sel] = self._data[dest[sel], : out.shape[1]]

    # -- reads (self._qlock held for _pump/_start; tasks run on the pool) ------------------

    def _pump(self) -> None:
        while self._queue and self._running < self._inflight and not self._closed:
            self._start(self._queue.popleft(), prefetch=True)

    def _start(self, b: _Batch, prefetch: bool = False) -> None:
        b.started = True
        live = b.slots >= 0
        tasks = self._plan(b.keys[live], b.slots[live])
        if prefetch:
            self._running += 1
        if not tasks:
            self._finish(b, prefetch)
            return
        b.left = len(tasks)
        for task in tasks:
            self._pool.submit(self._run, b, task, prefetch)

    def _plan(self, keys: np.ndarray, slots: np.ndarray) -> list[list[tuple]]:
        """Read tasks for these rows: per part, coalesced aligned windows, a few per task.
        A window is (part, file offset, nbytes, need, slots, byte offsets in the file)."""
        if not keys.size:
            return []
        t_of = np.searchsorted(self._base, keys, side="right") - 1
        windows = []
        for t in np.unique(t_of):
            table = self.tables[int(t)]
            mine = t_of == t
            rows, dest = keys[mine] - self._base[t], slots[mine]
            col = 0
            for part in table.parts:
                windows.extend(self._windows(part, col, rows, dest))
                col += part.row_bytes
        tasks: list[list[tuple]] = []
        for w in windows:
            if not tasks or len(tasks[-1]) >= TASK_WINDOWS:
                tasks.append([])
            tasks[-1].append(w)
        return tasks

    def _windows(self, part: RowArray, col: int, rows: np.ndarray, dest: np.ndarray) -> list[tuple]:
        a, rb = directio.ALIGN, part.row_bytes
        off = part.offset + rows * rb
        order = np.argsort(off, kind="stable")
        off, rows, dest = off[order], rows[order], dest[order]
        lo = off // a * a
        hi = -(-(off + rb) // a) * a
        out = []
        i = 0
        n = off.size
        while i < n:
            j = i + 1
            w_lo, w_hi = int(lo[i]), int(hi[i])
            while j < n and lo[j] <= w_hi and hi[j] - w_lo <= self._max_window:
                w_hi = max(w_hi, int(hi[j]))
                j += 1
            need = int(off[j - 1]) + rb - w_lo
            out.append((part, col, w_lo, w_hi - w_lo, need, dest[i:j], off[i:j], rows[i:j]))
            i = j
        return out

    def _run(self, b: _Batch, task: list[tuple], prefetch: bool) -> None:
        """(Reader thread.) Read the task's windows and place their rows; the last task of a
        batch signals it. Errors are kept on the batch for the caller."""
        try:
            for ev in b.after:
                ev.wait()
            self._io_begin()
            got = 0
            try:
                buf = directio.aligned_buffer(max(w[3] for w in task))
                for part, col, w_lo, nbytes, need, dest, off, rows in task:
                    got += self._files.read(directio.Window(part.path, w_lo, nbytes, 0, need), buf)
                    rb = part.row_bytes
                    self._data[dest, col : col + rb] = window_rows(buf, w_lo, off, rb)
                    if self._verifier is not None:
                        self._verify(b, part, col, dest, off, rows)
            finally:
                self._io_end(got, len(task))
        except Dsv4Error as e:
            self._fail(b, e)
        except OSError as e:
            self._fail(b, ReadError(f"{e.filename or 'row read'}: {e.strerror or e}; check the disk"))
        except BaseException as e:  # noqa: BLE001 (a bug: re-raised as itself in the caller)
            self._fail(b, e)
        finally:
            with self._qlock:
                b.left -= 1
                if b.left == 0:
                    self._finish(b, prefetch)

    def _verify(self, b: _Batch, part: RowArray, col: int, dest: np.ndarray, off: np.ndarray, rows: np.ndarray) -> None:
        rb = part.row_bytes
        parts = [
            Part(part.path, part.name, int(r) * rb, int(o), self._data[int(s), col : col + rb])
            for s, o, r in zip(dest, off, rows, strict=True)
        ]
        try:
            self._verifier.check(f"{part.name} rows", parts)
        except Dsv4Error:
            with self._stat_lock:
                self._r["verify_mismatches"] += 1
            raise
        if col == 0:  # a row counts once, with its first part (every part is checked)
            with self._stat_lock:
                self._r["verified_rows"] += len(parts)

    def _fail(self, b: _Batch, e: BaseException) -> None:
        with self._qlock:
            if b.error is None:
                b.error = e

    def _finish(self, b: _Batch, prefetch: bool) -> None:
        """(self._qlock held.) The batch's reads ended: signal it, start the next queued one."""
        if b.error is None:
            self._batches.pop(b.bid, None)  # a failed batch stays until a request reports it
            with self._stat_lock:
                self._r["rows_read"] += int((b.slots >= 0).sum())
        b.done.set()
        if prefetch:
            self._running -= 1
            self._pump()

    def _io_begin(self) -> None:
        with self._stat_lock:
            if self._active == 0:
                self._busy_since = time.perf_counter()
            self._active += 1

    def _io_end(self, nbytes: int, reads: int) -> None:
        with self._stat_lock:
            self._active -= 1
            if self._active == 0:
                self._read_seconds += time.perf_counter() - self._busy_since
            self._r["bytes_read"] += nbytes
            self._r["reads"] += reads


def window_rows(buf: np.ndarray, file_offset: int, offsets: np.ndarray, row_bytes: int) -> np.ndarray:
    """The rows at file ``offsets`` out of a window read from ``file_offset`` into ``buf``:
    (n, row_bytes). A row sits at its own residue: ``offset - file_offset`` into the buffer."""
    return buf[(offsets - file_offset)[:, None] + np.arange(row_bytes)]


def _first_occurrence(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys in first-occurrence order, and each key's index into them."""
    u, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return u[order], rank[inv.reshape(-1)]
