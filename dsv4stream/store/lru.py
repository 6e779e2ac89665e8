"""The expert store's bookkeeping without buffers, files or threads: which key owns which
slot, the LRU order, pins, claims and the request counters.

`cache.ExpertStore` runs its reads around it and `simulate.StoreModel` replays route logs
through it, so a what-if replay applies exactly the rules of the live store (written down
in `cache`'s module doc: what is a hit, which entry is the victim, which slot a new entry
gets). Every decision here depends only on the sequence of calls, never on read timing.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..errors import BudgetError, InternalError


class Entry:
    """One key's occupancy of a slot: ``claimed`` once a request asked for it (a prefetch
    nobody asked for yet is unclaimed), ``pins`` = gets not yet released."""

    __slots__ = ("claimed", "key", "pins", "slot")

    def __init__(self, key: Hashable, slot: int, claimed: bool) -> None:
        self.key = key
        self.slot = slot
        self.claimed = claimed
        self.pins = 0


E = TypeVar("E", bound=Entry)


@dataclass
class Counts:
    """Request-side counters (see `cache`'s module doc for what each counts)."""

    requests: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    prefetches: int = 0
    prefetch_used: int = 0
    prefetch_unused: int = 0


def pinned_error(slots: int) -> BudgetError:
    return BudgetError(
        f"all {slots} expert slots are pinned; release items before getting more "
        "or give the store more slots (raise --budget)"
    )


class SlotLru(Generic[E]):
    """``slots`` slots, numbered 0..slots-1, handed to keys under the store's rules.

    ``entry(key, slot, claimed)`` makes the per-key record (the store's carries its read
    state). Calls that take a slot return the evicted entry, if any, so the caller can wait
    for a read still in flight before reusing its slot."""

    def __init__(self, slots: int, entry: Callable[[Hashable, int, bool], E] = Entry) -> None:  # type: ignore[assignment]
        self.slots = slots
        self.entries: OrderedDict[Hashable, E] = OrderedDict()  # oldest first
        self.n = Counts()
        self._free = list(range(slots))  # a heap: lowest slot first
        self._lent: list[int] = []  # slots lent out (`lend`): neither free nor owned
        self._entry = entry
        self._pinned = 0  # entries of `entries` with pins > 0: `pinned()` without a scan

    def __contains__(self, key: Hashable) -> bool:
        return key in self.entries

    def get(self, key: Hashable) -> E | None:
        return self.entries.get(key)

    def pinned(self) -> int:
        """Slots whose entry is pinned now (kept as a count: a step asks for it per layer)."""
        return self._pinned

    @property
    def lent(self) -> int:
        """Slots lent out now."""
        return len(self._lent)

    def is_lent(self, slot: int) -> bool:
        return slot in self._lent

    def lend(self, n: int) -> list[tuple[int, E | None]]:
        """Take `n` more slots out of use (a prefill's activations live in their bytes): free
        ones first (lowest first), then the victims a demand read would evict, oldest first.
        Returns each slot lent with the entry it held (an eviction). Raises if only pinned
        entries are left: nothing is pinned between passes, when slots are lent."""
        out = []
        for _ in range(n):
            got = self._take(prefetch=False)
            if got is None:
                raise InternalError(f"cannot lend an expert slot: all {self.slots - self.lent} in use are pinned")
            self._lent.append(got[0])
            out.append(got)
        return out

    def unlend(self) -> list[int]:
        """Every lent slot back to the free ones (empty; handed out lowest first again)."""
        back, self._lent = self._lent, []
        for slot in back:
            heapq.heappush(self._free, slot)
        return back

    def prefetch(self, keys: Sequence[Hashable]) -> list[tuple[E, E | None]]:
        """Touch the present ``keys``, then give each absent one a slot while one can be had
        without evicting a pinned entry, an unclaimed one or one of ``keys``. Returns the new
        (unclaimed) entries, each with the entry it evicted."""
        for key in keys:
            if key in self.entries:
                self.entries.move_to_end(key)
        batch = set(keys)
        out = []
        for key in keys:
            if key in self.entries:
                continue
            got = self._take(prefetch=True, keep=batch)
            if got is None:
                break
            out.append(self._add(key, *got, claimed=False))
            self.n.prefetches += 1
        return out

    def acquire(self, key: Hashable) -> tuple[E, E | None, bool]:
        """Count one request for ``key`` and pin it: (entry, evicted entry, whether it is new
        and must be read)."""
        self.n.requests += 1
        entry = self.entries.get(key)
        if entry is None:
            self.n.misses += 1
            got = self._take(prefetch=False)
            if got is None:
                raise pinned_error(self.slots)
            entry, evicted = self._add(key, *got, claimed=True)
            self._pin(entry)
            return entry, evicted, True
        if entry.claimed:
            self.n.hits += 1
        else:
            self.n.misses += 1
            self.n.prefetch_used += 1
            entry.claimed = True
        self.entries.move_to_end(key)
        self._pin(entry)
        return entry, None, False

    def release(self, key: Hashable) -> None:
        """Undo one ``acquire(key)``."""
        entry = self.entries.get(key)
        if entry is None or entry.pins == 0:
            raise InternalError(f"release({key!r}) without a matching get")
        self._unpin(entry)

    def unpin(self, entry: E) -> None:
        """Undo one acquire of this very entry (it may have been dropped since)."""
        if entry.pins == 0:
            raise InternalError(f"unpin of {entry.key!r}, which holds no pin")
        self._unpin(entry)

    def _pin(self, entry: E) -> None:
        if entry.pins == 0 and self.entries.get(entry.key) is entry:
            self._pinned += 1
        entry.pins += 1

    def _unpin(self, entry: E) -> None:
        entry.pins -= 1
        if entry.pins == 0 and self.entries.get(entry.key) is entry:
            self._pinned -= 1

    def drop(self, entry: E) -> None:
        """Forget ``entry`` (its read failed) and free its slot, unless a newer entry owns the key."""
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
            if entry.pins:
                self._pinned -= 1  # a later unpin of it no longer counts
            heapq.heappush(self._free, entry.slot)

    def many_order(self, keys: Iterable[Hashable]) -> tuple[list[Hashable], int]:
        """``get_many``'s acquisition order (present entries first, then the absent, each in
        request order) and ``cap``, the most it may pin at once (the unpinned slots)."""
        keys = list(keys)
        order = [k for k in keys if k in self.entries] + [k for k in keys if k not in self.entries]
        cap = min(len(order), self.slots - self.lent - self.pinned())
        if order and cap < 1:
            raise pinned_error(self.slots)
        return order, cap

    def _add(self, key: Hashable, slot: int, evicted: E | None, claimed: bool) -> tuple[E, E | None]:
        entry = self._entry(key, slot, claimed)
        self.entries[key] = entry
        return entry, evicted

    def _take(self, prefetch: bool, keep: frozenset | set = frozenset()) -> tuple[int, E | None] | None:
        """A free slot (lowest first), else the victim's; None when there is no victim.

        The victim is the oldest unpinned claimed entry outside ``keep``; for a demand read,
        failing that, the oldest unpinned unclaimed one (a prefetch of a later layer is worth
        more than an expert already used, but a demand read must proceed). A prefetch never
        evicts an unclaimed entry."""
        if self._free:
            return heapq.heappop(self._free), None
        later = None
        victim = None
        for key, e in self.entries.items():
            if e.pins:
                continue
            if e.claimed and key not in keep:
                victim = key
                break
            if not prefetch and later is None and not e.claimed:
                later = key
        victim = later if victim is None else victim
        if victim is None:
            return None
        entry = self.entries.pop(victim)
        self.n.evictions += 1
        if not entry.claimed:
            self.n.prefetch_unused += 1
        return entry.slot, entry
