"""ExpertStore: a fixed number of slots holding items read from their files, LRU-managed.

Owns the slots (one aligned buffer), the reader threads, read counters and the route log.
The LRU order, pins, claims and request counters are ``lru.SlotLru``'s (shared with
``simulate.StoreModel``, so a replay follows these rules exactly). It knows nothing about
the model: keys are any hashable, an item is a ``Layout`` (runs of pieces), and ``get``
hands back one numpy view per piece. Alignment and file access live in ``directio``; the
byte-for-byte check in ``verify``.

Pin protocol
    ``get(key)`` returns zero-copy views into the key's slot and *pins* it: the slot is
    neither evicted nor overwritten until a matching ``release(key)`` (one per ``get``).
    ``hold(key)`` is the same as a context manager. ``get_many(keys)`` hands out each item
    in turn, the ones in memory first and the rest as their reads land, each pinned at
    least until the generator advances. A view used after its release may show another
    item's bytes: copy it if it must outlive the pin.
    An in-flight read is never given a new owner: evicting an entry whose read has not
    finished makes the next read into that slot wait for it first.

Determinism
    Hits, misses, evictions and the LRU order depend only on the sequence of calls
    (``prefetch``/``get``/``get_many``/``release``), never on when reads complete: an
    in-flight entry sits in the LRU like a resident one, victims are the oldest unpinned
    entries (claimed ones before unrequested prefetches), free slots are handed out lowest
    first, and ``get_many`` acquires in an order fixed when its iteration starts (present
    entries first, then the rest, each in request order, releasing by position); only the
    order it *yields* in follows the reads.

Counting
    A request is a hit when the entry was present and already claimed by an earlier
    request. The first request for an entry that ``prefetch`` loaded counts as a miss
    (its bytes were read for it; ``prefetch_used`` says the read was started early), so
    ``misses`` equals reads attributed to requests whatever the prefetching.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Self

import numpy as np

from ..errors import Dsv4Error, ReadError, StoreError
from . import directio
from .lru import Entry, SlotLru
from .runs import Layout
from .verify import Part, Verifier


@dataclass(frozen=True)
class StoreStats:
    """Counters since the store opened. Times in seconds, bytes as read from disk
    (aligned windows, so slightly more than the pieces themselves)."""

    requests: int
    hits: int
    misses: int
    evictions: int
    prefetches: int
    prefetch_used: int
    prefetch_unused: int
    bytes_read: int  # of finished reads: a snapshot taken while prefetches run counts fewer
    read_seconds: float  # wall time with at least one read in flight
    read_gbps: float  # bytes_read / read_seconds / 1e9
    wait_seconds: float  # time callers blocked on reads: I/O not hidden behind compute
    verified_reads: int
    verify_mismatches: int
    slots: int
    slot_bytes: int
    io: str
    fallback_files: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0


@dataclass
class _ReadCounts:
    """Read-side counters, moved under the stats lock (request-side ones are the LRU's)."""

    bytes_read: int = 0
    verified_reads: int = 0
    verify_mismatches: int = 0


class _Entry(Entry):
    """An LRU entry with its read: ``done`` is set once the read finished (views or error
    filled in); readers never take the store lock, so waiting on ``done`` while holding it
    cannot deadlock. ``after``: the evicted entry's read, to finish before this one starts."""

    __slots__ = ("after", "done", "error", "views")

    def __init__(self, key: Hashable, slot: int, claimed: bool) -> None:
        super().__init__(key, slot, claimed)
        self.done = threading.Event()
        self.views: tuple[np.ndarray, ...] = ()
        self.error: BaseException | None = None
        self.after: threading.Event | None = None


def _route_line(key: Hashable) -> str:
    if isinstance(key, tuple):
        return " ".join(str(k) for k in key) + "\n"
    return f"{key}\n"


class ExpertStore:
    """LRU cache of ``slots`` items read from ``layouts`` (see module doc for the protocol).

    ``io``: "direct" (O_DIRECT, falling back to buffered where refused) or "buffered".
    ``threads``: reader threads (the queue depth). ``verify``: re-read every load through
    ``Verifier`` and raise VerifyError on a difference. ``order``: per key, the indices
    (into layout order) of the pieces ``get`` returns, in the order it returns them
    (``layout.ExpertLayouts.order`` gives w1.weight, w1.scale, w2.weight, ...); default:
    all pieces in layout order. ``route_log``: path or text file;
    one line per request (a tuple key's parts joined by spaces). ``label`` names a key in
    error messages. ``warn`` receives the one-time O_DIRECT fallback notice.
    """

    def __init__(
        self,
        layouts: Mapping[Hashable, Layout],
        slots: int,
        io: str = "direct",
        threads: int = 4,
        verify: bool = False,
        route_log: str | os.PathLike | IO[str] | None = None,
        label: Callable[[Hashable], str] = str,
        warn: Callable[[str], None] | None = None,
        order: Mapping[Hashable, Sequence[int]] | None = None,
    ) -> None:
        if slots < 1 or threads < 1:
            raise StoreError(f"an expert store needs slots >= 1 and threads >= 1, got {slots} and {threads}")
        self._layouts = layouts
        self._order = order
        self._plans = {k: directio.plan_slot(lay) for k, lay in layouts.items()}
        self.slot_bytes = max((p.nbytes for p in self._plans.values()), default=directio.ALIGN)
        self.slots = slots
        self._paged = directio.PagedBuffer(slots * self.slot_bytes)  # lent slots' pages go back to the kernel
        self._fault_lock = threading.Lock()  # `populate`'s current slot; taken before the store lock
        self._faulting: threading.Thread | None = None
        self._buf = self._paged.array
        self._files = directio.FileSet(io, warn)
        self._verifier = Verifier() if verify else None
        self._label = label
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dsv4-io")
        self._lock = threading.Lock()
        self._landed_cv = threading.Condition()  # notified whenever a read finishes
        self._lru: SlotLru[_Entry] = SlotLru(slots, _Entry)
        self._closed = False
        self._route, self._own_route = self._open_route(route_log)
        self._n = _ReadCounts()
        self._stat_lock = threading.Lock()
        self._active_reads = 0
        self._busy_since = 0.0
        self._read_seconds = 0.0
        self._wait_seconds = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes the slots occupy once all are used (what the budget must cover)."""
        return self.slots * self.slot_bytes

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The reader threads, for another reader of the same disks to share (e.g. the Engram
        row cache): it must be closed before this store, which shuts them down."""
        return self._pool

    @staticmethod
    def slot_nbytes(layouts: Mapping[Hashable, Layout]) -> int:
        """Bytes one slot needs for these layouts (for budget planning)."""
        return max((directio.plan_slot(lay).nbytes for lay in layouts.values()), default=0)

    # -- context manager -------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for reads in flight, then close files and the route log. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._faulting is not None:
            self._faulting.join()
        self._pool.shutdown(wait=True)
        self._files.close()
        if self._verifier is not None:
            self._verifier.close()
        if self._route is not None:
            self._route.flush()
            if self._own_route:
                self._route.close()

    # -- public API ------------------------------------------------------------------

    def prefetch(self, keys: Iterable[Hashable]) -> None:
        """Start reading ``keys`` that are not present; present ones become most recent.

        A hint: it never evicts a pinned entry, another prefetch not yet requested, or
        one of ``keys`` (present ones are touched first, so a read started for one key
        cannot push out another key of the same batch), and stops quietly when only such
        entries are left. Not counted as requests."""
        keys = list(keys)
        with self._lock:
            self._check_open()
            for key in keys:
                self._check_key(key)
            for entry, evicted in self._lru.prefetch(keys):
                self._start(entry, evicted)

    def get(self, key: Hashable) -> tuple[np.ndarray, ...]:
        """The pieces of ``key`` (layout order, or ``order[key]``), pinned until ``release(key)``."""
        with self._lock:
            self._check_open()
            self._log(key)
            entry = self._acquire(key)
        return self._wait(entry)

    def release(self, key: Hashable) -> None:
        """Undo one ``get(key)``: its views may be overwritten from now on."""
        with self._lock:
            self._lru.release(key)

    @contextmanager
    def hold(self, key: Hashable) -> Iterator[tuple[np.ndarray, ...]]:
        """``get(key)`` as a context manager; released on exit."""
        views = self.get(key)
        try:
            yield views
        finally:
            self.release(key)

    def get_many(self, keys: Iterable[Hashable]) -> Iterator[tuple[Hashable, tuple[np.ndarray, ...]]]:
        """Yield ``(key, views)`` once for each of the distinct ``keys``: entries whose bytes
        are in memory first, then the others in the order their reads complete.

        Requests are logged in the order given, at the first ``next()``. The order of
        *acquisition* (counting, LRU, pins) is fixed then, by the calls so far only: entries
        present (loaded or loading) first, then the absent, each in request order; at most
        ``cap`` = the unpinned slots are pinned at once, and the key at position i >= cap
        is acquired right after the one at i - cap has been yielded and is released then.
        The others a consumer has finished with stay pinned until their turn comes or the
        generator ends, so hits and victims never depend on read timing; only the yield
        order does. An item's views are valid until the generator advances."""
        for group in self._many(keys, together=False):
            yield group[0]

    def get_groups(self, keys: Iterable[Hashable]) -> Iterator[list[tuple[Hashable, tuple[np.ndarray, ...]]]]:
        """``get_many`` handing its items in groups pinned together: each group is every item
        whose read has finished when the previous group was consumed (so, when the keys' entries
        are all in memory and fit the unpinned slots, one group of them all), and all of a
        group's views stay valid until the generator advances. Acquisition, counting and victims
        are ``get_many``'s exactly (so a route-log replay is unchanged): at most ``cap`` = the
        unpinned slots are pinned, so holding a group never takes a slot the plan did not give
        or a pinned one. When the keys do not all fit, a group holds at most half of ``cap``
        (at least one), so that the next keys' reads proceed while the consumer computes."""
        return self._many(keys, together=True)

    def _many(
        self, keys: Iterable[Hashable], together: bool
    ) -> Iterator[list[tuple[Hashable, tuple[np.ndarray, ...]]]]:
        """``get_many`` (together False: groups of one) and ``get_groups``."""
        keys = list(keys)
        with self._lock:
            self._check_open()
            for key in keys:
                self._check_key(key)
                self._log(key)
            order, cap = self._lru.many_order(keys)
            pending = {i: self._acquire(order[i]) for i in range(cap)}
        kept: dict[int, _Entry] = {}  # yielded, pin kept until its successor's turn
        nxt = cap
        # a group of all that landed when every key is pinned already; else at most half the
        # pins, so the reads of the other half go on while the consumer works on this one
        if not together:
            most = 1  # get_many: one item a turn (a larger group would lose all but its first)
        else:
            most = len(order) if cap >= len(order) else max(1, cap // 2)
        try:
            while pending:
                landed = self._landed(pending)
                group = []
                for i in landed[:most]:
                    entry = pending.pop(i)
                    views = self._wait(entry)  # on error it unpins the entry itself
                    kept[i] = entry
                    group.append((order[i], views))
                yield group
                with self._lock:
                    while nxt < len(order) and nxt - cap in kept:
                        self._lru.unpin(kept.pop(nxt - cap))
                        self._check_open()
                        pending[nxt] = self._acquire(order[nxt])
                        nxt += 1
        finally:
            with self._lock:
                for entry in (*pending.values(), *kept.values()):
                    self._lru.unpin(entry)

    def _landed(self, pending: Mapping[int, _Entry]) -> list[int]:
        """(Lock NOT held.) The positions in ``pending`` whose read has finished, ascending,
        waiting for one to finish when none has."""
        t0 = None
        with self._landed_cv:
            while True:
                done = [i for i, e in pending.items() if e.done.is_set()]
                if done:
                    break
                if t0 is None:
                    t0 = time.perf_counter()
                self._landed_cv.wait(0.05)
        if t0 is not None:
            with self._stat_lock:
                self._wait_seconds += time.perf_counter() - t0
        return sorted(done)

    @property
    def wait_seconds(self) -> float:
        """Time callers have blocked on reads so far (cheap: for per-token profiles)."""
        return self._wait_seconds

    def populate(self) -> None:
        """Start faulting the slots' pages in, lowest slot first, on a thread of their own
        (skipping lent slots; `wait_populated` joins it, `close` stops it).

        A page's first touch costs far more than a read into it: measured 1.1-5.5 s per GB on
        a loaded 2-core VM, against 0.15-0.25 s per GB for pages the VM had backed before.
        Paid inside the reads, it made a prefill slower at a larger budget (more fresh slots
        touched); paid ahead, beside the trunk's load, it does not. Where the kernel refuses
        (before Linux 5.14) the pages fault in as reads land, as before."""
        if self._faulting is None and not self._closed:
            self._faulting = threading.Thread(target=self._populate_all, name="dsv4-populate", daemon=True)
            self._faulting.start()

    def wait_populated(self) -> None:
        """Until the thread `populate` started has faulted every slot in (at once when none runs)."""
        if self._faulting is not None:
            self._faulting.join()

    def _populate_all(self) -> None:
        """(Populate thread.) One slot at a time under the fault lock, which `lend` takes first:
        a slot being lent is never faulted back in behind its release."""
        for slot in range(self.slots):
            with self._fault_lock:
                if self._closed:
                    return
                with self._lock:
                    if self._lru.is_lent(slot):
                        continue
                if not self._paged.populate(slot * self.slot_bytes, (slot + 1) * self.slot_bytes):
                    return

    @property
    def lent(self) -> int:
        """Slots lent out now (`lend`)."""
        return self._lru.lent

    def lend(self, n: int) -> None:
        """Have exactly ``n`` slots lent out: their bytes leave the resident set for another
        user of the budget (a prefill segment's activations) until a later ``lend`` with a
        smaller ``n`` gives them back, empty. More slots are taken like a demand read's victim
        (free ones first, then the least recently used), so what stays cached is the most
        recent; an evicted entry's read in flight is waited for first. Call between passes:
        nothing may be pinned in a slot that must go."""
        if not 0 <= n < self.slots:
            raise StoreError(f"lend({n}): a store of {self.slots} slots lends 0 to {self.slots - 1}")
        with self._fault_lock, self._lock:
            self._check_open()
            if n < self._lru.lent:
                self._lru.unlend()
            for slot, evicted in self._lru.lend(n - self._lru.lent):
                if evicted is not None:
                    evicted.done.wait()  # readers never take the lock: no deadlock
                self._paged.release(slot * self.slot_bytes, (slot + 1) * self.slot_bytes)

    def resident(self) -> list[Hashable]:
        """Keys that hold a slot now (present or being read), least recently used first: a
        copy taken under the lock, for displays."""
        with self._lock:
            return list(self._lru.entries)

    def stats(self) -> StoreStats:
        with self._lock, self._stat_lock:
            # vars, not asdict (a deep copy through every field's type): flat int counters, and the
            # engine's meter reads these twice a decode step
            n = {**vars(self._lru.n), **vars(self._n)}
            seconds = self._read_seconds
            if self._active_reads:
                seconds += time.perf_counter() - self._busy_since
            fallback = len(self._files.fallback_paths)
        return StoreStats(
            **n,
            read_seconds=seconds,
            read_gbps=n["bytes_read"] / seconds / 1e9 if seconds > 0 else 0.0,
            wait_seconds=self._wait_seconds,
            slots=self.slots,
            slot_bytes=self.slot_bytes,
            io=self._files.io,
            fallback_files=fallback,
        )

    # -- internals (called with self._lock held unless said otherwise) ----------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the expert store is closed")

    def _check_key(self, key: Hashable) -> None:
        if key not in self._layouts:
            raise StoreError(f"no layout for key {key!r}: the store knows only the checkpoint's routed experts")

    def _log(self, key: Hashable) -> None:
        if self._route is not None:
            self._route.write(_route_line(key))

    def _acquire(self, key: Hashable) -> _Entry:
        """Count one request for ``key``, make sure it is present or loading, pin it."""
        self._check_key(key)
        entry, evicted, new = self._lru.acquire(key)
        if new:
            self._start(entry, evicted)
        return entry

    def _start(self, entry: _Entry, evicted: _Entry | None) -> None:
        """Read ``entry``; into an evicted entry's slot only once that entry's read finished."""
        if evicted is not None and not evicted.done.is_set():
            entry.after = evicted.done
        self._pool.submit(self._load, entry)

    def _slot(self, index: int) -> np.ndarray:
        return self._buf[index * self.slot_bytes : (index + 1) * self.slot_bytes]

    def _wait(self, entry: _Entry) -> tuple[np.ndarray, ...]:
        """(Lock NOT held.) Block until ``entry`` is read; raise its error, if any."""
        if not entry.done.is_set():
            t0 = time.perf_counter()
            entry.done.wait()
            with self._stat_lock:
                self._wait_seconds += time.perf_counter() - t0
        if entry.error is not None:
            with self._lock:
                self._lru.unpin(entry)
                # The slot holds garbage and nobody holds views of it: reuse it now, so a
                # retry reads afresh.
                self._lru.drop(entry)
            raise entry.error
        return entry.views

    def _load(self, entry: _Entry) -> None:
        """(Reader thread, lock NOT held.) Read, place, optionally verify, then signal."""
        try:
            if entry.after is not None:
                entry.after.wait()
                entry.after = None
            layout = self._layouts[entry.key]
            plan = self._plans[entry.key]
            slot = self._slot(entry.slot)
            self._io_begin()
            nread = 0
            try:
                for window in plan.windows:
                    nread += self._files.read(window, slot)
            finally:
                self._io_end(nread)
            views = directio.piece_views(slot, layout, plan)
            if self._verifier is not None:
                try:
                    parts = [Part(run.path, p.name, 0, p.offset, v)
                             for (run, p), v in zip(((r, p) for r in layout for p in r.pieces), views, strict=True)]  # fmt: skip
                    self._verifier.check(self._label(entry.key), parts)
                except Dsv4Error:
                    with self._stat_lock:
                        self._n.verify_mismatches += 1
                    raise
                with self._stat_lock:
                    self._n.verified_reads += 1
            if self._order is not None:
                views = tuple(views[i] for i in self._order[entry.key])
            entry.views = views
        except Dsv4Error as e:
            entry.error = type(e)(f"{self._label(entry.key)}: {e}")
            entry.error.__cause__ = e
        except OSError as e:
            where = f" {e.filename}" if e.filename else ""
            entry.error = ReadError(f"{self._label(entry.key)}:{where} {e.strerror or e}; check the disk")
            entry.error.__cause__ = e
        except BaseException as e:  # noqa: BLE001 (a bug: re-raised as itself in the caller, with its traceback)
            entry.error = e
        finally:
            entry.done.set()
            with self._landed_cv:
                self._landed_cv.notify_all()

    def _io_begin(self) -> None:
        with self._stat_lock:
            if self._active_reads == 0:
                self._busy_since = time.perf_counter()
            self._active_reads += 1

    def _io_end(self, nbytes: int) -> None:
        with self._stat_lock:
            self._active_reads -= 1
            if self._active_reads == 0:
                self._read_seconds += time.perf_counter() - self._busy_since
            self._n.bytes_read += nbytes

    @staticmethod
    def _open_route(route_log: str | os.PathLike | IO[str] | None) -> tuple[IO[str] | None, bool]:
        if route_log is None:
            return None, False
        if hasattr(route_log, "write"):
            return route_log, False
        return open(route_log, "w", encoding="ascii"), True
