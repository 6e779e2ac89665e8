"""What-if replay of a route log through cache policies: LRU as the store runs it, a
frequency-pinned cache, and Belady's optimum.

Owns: reading a route log (the store's ``--route-log``: one ``layer expert`` line per
request, in request order) and the policies below; LRU replays through the store's own
bookkeeping (``store.lru.SlotLru``). It reads no checkpoint and knows the model only through the
engine's prefetch pattern (``engine_calls``).

Counting, as in ``dsv4stream.store.cache``: every line is a request; a request is a hit
when its expert is resident and was already requested once since it was loaded, otherwise
a miss that reads the expert (a prefetched expert's first request is a miss: its bytes
were read for it). All policies start cold, so each distinct expert costs one compulsory
miss. Bytes read = misses x expert bytes (the store reads aligned windows, a few pages
more per expert).

Policies (``slots`` = experts the cache holds):
  lru      the store exactly. ``hints="engine"`` replays the calls the engine makes
           around the requests (``engine_calls``: prefetch hints, one pin) through
           ``StoreModel``, the store's rules without its buffers. A prefetch first touches
           its keys already present and never evicts one of its own keys, a pinned entry
           or an unrequested prefetch, so a layer's resident experts all hit even where
           plain LRU would evict one while loading the others. ``hints="none"`` is plain
           LRU on the requests (what the store does when only ``get`` is called).
  pinned   static: the ``slots - 1`` most requested experts of the whole log are pinned
           (ties to the lower (layer, expert)); every other request is read into the one
           remaining slot, used and dropped. An oracle profile: a real run would take it
           from an earlier run's log.
  pinned+lru  ``slots - lru_slots`` pinned as above (``lru_slots`` = ``lru_share`` of the
           slots, at least 1), the other requests through LRU in ``lru_slots`` slots.
  belady   optimal demand paging: on a miss with the cache full, evict the resident
           expert whose next request is farthest (never requested again first). No
           policy with ``slots`` slots has more hits; in particular never below LRU.
"""

from __future__ import annotations

import heapq
import os
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import UsageError
from ..store.lru import Counts, Entry, SlotLru

POLICIES = ("lru", "pinned", "pinned+lru", "belady")


@dataclass(frozen=True)
class SimResult:
    """One policy at one cache size. ``bytes_read`` = misses x expert bytes (0 if unknown)."""

    policy: str
    slots: int
    requests: int
    hits: int
    misses: int
    bytes_read: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


# ---- route logs --------------------------------------------------------------------


def read_route_log(path: str | os.PathLike) -> np.ndarray:
    """A route log file -> (N, 2) int64 array of (layer, expert), in request order."""
    try:
        with open(path, encoding="ascii") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot read route log ({e}); check the path") from e
    lines = [ln for ln in lines if ln.strip()]
    fields = " ".join(lines).split()
    try:
        flat = np.array(fields, dtype=np.int64)
    except ValueError:
        flat = np.zeros(1, dtype=np.int64)  # odd length: reported below
    if flat.size != 2 * len(lines) or (flat.size and flat.min() < 0):
        raise UsageError(
            f"{path}: not a route log (expected one 'layer expert' pair of non-negative integers per line,"
            " as written by --route-log)"
        )
    return flat.reshape(-1, 2)


def key_ids(log: np.ndarray) -> np.ndarray:
    """(N, 2) (layer, expert) -> (N,) dense int64 ids that order like (layer, expert)."""
    if log.size == 0:
        return np.zeros(0, dtype=np.int64)
    width = int(log[:, 1].max()) + 1
    return log[:, 0].astype(np.int64) * width + log[:, 1]


def forward_passes(log: np.ndarray) -> int:
    """Forward passes (chunks) in a log: within one, (layer, expert) strictly ascends."""
    ids = key_ids(log)
    return int(ids.size > 0) + int(np.count_nonzero(ids[1:] <= ids[:-1]))


def distinct(log: np.ndarray) -> int:
    """Distinct (layer, expert) keys requested."""
    return int(np.unique(key_ids(log)).size)


def _result(policy: str, slots: int, hits: int, n: int, expert_bytes: int) -> SimResult:
    return SimResult(policy, slots, n, hits, n - hits, (n - hits) * expert_bytes)


# ---- policies (ids: a sequence of hashable keys, one per request) ------------------


def lru(ids: Sequence[Hashable], slots: int, expert_bytes: int = 0) -> SimResult:
    """Plain LRU on the requests: a hit if resident; a miss evicts the least recently requested."""
    _check_slots(slots)
    cache: OrderedDict[Hashable, None] = OrderedDict()
    hits = sum(_lru_hit(cache, k, slots) for k in ids)
    return _result("lru", slots, hits, len(ids), expert_bytes)


def _lru_hit(cache: OrderedDict[Hashable, None], k: Hashable, slots: int) -> bool:
    """One request through an LRU of `slots` keys: True on a hit; a miss evicts the oldest."""
    if k in cache:
        cache.move_to_end(k)
        return True
    if len(cache) >= slots:
        cache.popitem(last=False)
    cache[k] = None
    return False


def pinned(ids: Sequence[Hashable], slots: int, lru_slots: int = 1, expert_bytes: int = 0) -> SimResult:
    """The ``slots - lru_slots`` most requested keys pinned (each read on its first request),
    the other requests through LRU in ``lru_slots`` slots (at least one: an expert must sit
    in a slot to be computed)."""
    _check_slots(slots)
    if not 1 <= lru_slots <= slots:
        raise ValueError(f"lru_slots must be in 1..{slots}, got {lru_slots}")
    counts = Counter(ids)
    # Most requested first; ties to the smaller key so the choice is deterministic.
    ranked = sorted(counts, key=lambda k: (-counts[k], k))
    pins = set(ranked[: slots - lru_slots])
    loaded: set[Hashable] = set()
    cache: OrderedDict[Hashable, None] = OrderedDict()
    hits = 0
    for k in ids:
        if k in pins:
            if k in loaded:
                hits += 1
            else:
                loaded.add(k)
        elif _lru_hit(cache, k, lru_slots):
            hits += 1
    name = "pinned" if lru_slots == 1 else "pinned+lru"
    return _result(name, slots, hits, len(ids), expert_bytes)


def next_use(ids: Sequence[Hashable]) -> list[int]:
    """For each request i, the index of the next request of the same key (len(ids) if none)."""
    n = len(ids)
    out = [n] * n
    last: dict[Hashable, int] = {}
    for i in range(n - 1, -1, -1):
        k = ids[i]
        out[i] = last.get(k, n)
        last[k] = i
    return out


def belady(ids: Sequence[Hashable], slots: int, expert_bytes: int = 0, nxt: list[int] | None = None) -> SimResult:
    """Belady's MIN: evict the resident key requested again farthest in the future.

    A max-heap of (next use, key) with lazy deletion: a popped entry is stale unless the
    key is still resident with exactly that next use. O(N log slots). Keys must be
    mutually comparable (ids from ``key_ids``, or tuples)."""
    _check_slots(slots)
    nxt = next_use(ids) if nxt is None else nxt
    resident: dict[Hashable, int] = {}  # key -> index of its next request
    heap: list[tuple[int, Hashable]] = []  # (-next use, key)
    hits = 0
    for i, k in enumerate(ids):
        if k in resident:
            hits += 1
        elif len(resident) >= slots:
            while True:
                neg, victim = heapq.heappop(heap)
                if resident.get(victim) == -neg:
                    del resident[victim]
                    break
        resident[k] = nxt[i]
        heapq.heappush(heap, (-nxt[i], k))
        if len(heap) > 4 * slots + 64:  # shed stale entries; amortised O(1) per request
            heap = [(-v, key) for key, v in resident.items()]
            heapq.heapify(heap)
    return _result("belady", slots, hits, len(ids), expert_bytes)


# ---- the store's LRU, call for call ------------------------------------------------


class StoreModel:
    """``ExpertStore``'s request-side bookkeeping for ``prefetch``/``get``/``release``/
    ``get_many`` without buffers, files or threads: the store's own ``SlotLru`` driven call
    for call, so its counters are the store's for the same call sequence."""

    def __init__(self, slots: int) -> None:
        _check_slots(slots)
        self.slots = slots
        self._lru: SlotLru[Entry] = SlotLru(slots)

    @property
    def counts(self) -> Counts:
        """requests, hits, misses, evictions, prefetches, prefetch_used, prefetch_unused."""
        return self._lru.n

    def prefetch(self, keys: Iterable[Hashable]) -> None:
        self._lru.prefetch(list(keys))

    def get(self, key: Hashable) -> None:
        self._lru.acquire(key)

    def release(self, key: Hashable) -> None:
        self._lru.release(key)

    def get_many(self, keys: Sequence[Hashable]) -> None:
        """``ExpertStore.get_many`` consumed to the end: position i acquired once i - cap
        has been yielded and released."""
        order, cap = self._lru.many_order(keys)
        for i, key in enumerate(order):
            if i >= cap:
                self.release(order[i - cap])
            self.get(key)
        for key in order[max(0, len(order) - cap) :]:
            self.release(key)


RELEASES = ("many", "previous", "each")
Call = tuple[str, object]  # ("prefetch", [keys]) | ("get", key) | ("get_many", [keys]) | ("release", key)


def engine_calls(log: np.ndarray, hash_layers: int, release: str = "many") -> Iterator[Call]:
    """The store calls ``dsv4stream.engine.session`` makes for this route log.

    Per forward pass (a prefill segment or a decode step): first ``prefetch`` of every hash
    layer's experts (layer order, ascending experts: exactly what those layers will
    request), then per layer one ``get_many`` of its experts in ascending order (the engine
    calls ``get_groups``, whose acquisition, counters and victims are ``get_many``'s), each
    scored layer's preceded by a ``prefetch`` of the same keys. A forward pass ends where
    the layer number goes down (or a layer's experts stop ascending). ``release``: "many"
    (the engine's ``get_groups``), or one ``get`` per expert with "previous" (the expert got
    last stays pinned until the next get, as ``streaming.experts.StreamedExperts.get`` does), "each"
    (released right after its get)."""
    if release not in RELEASES:
        raise ValueError(f"release must be one of {', '.join(RELEASES)}, got {release!r}")
    rows = log.tolist()
    held = None
    start = 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and (rows[end][0], rows[end][1]) > (rows[end - 1][0], rows[end - 1][1]):
            end += 1
        passes = [tuple(r) for r in rows[start:end]]
        hashed = [k for k in passes if k[0] < hash_layers]
        if hashed:
            yield "prefetch", hashed
        i = 0
        while i < len(passes):
            j = i
            while j < len(passes) and passes[j][0] == passes[i][0]:
                j += 1
            group = passes[i:j]
            if group[0][0] >= hash_layers:
                yield "prefetch", group
            if release == "many":
                yield "get_many", group
                i = j
                continue
            for k in group:
                if held is not None:
                    yield "release", held
                yield "get", k
                if release == "each":
                    yield "release", k
                held = k if release == "previous" else None
            i = j
        start = end


def max_prefetch(log: np.ndarray, hash_layers: int) -> int:
    """The largest ``prefetch`` call ``engine_calls`` makes for this log (0 if none)."""
    return max((len(arg) for op, arg in engine_calls(log, hash_layers) if op == "prefetch"), default=0)


def run_calls(calls: Iterable[Call], slots: int) -> StoreModel:
    """A fresh ``StoreModel`` after these calls."""
    model = StoreModel(slots)
    for op, arg in calls:
        getattr(model, op)(*(() if arg is None else (arg,)))
    return model


def replay_store(
    log: np.ndarray, slots: int, hash_layers: int, release: str = "many", expert_bytes: int = 0
) -> SimResult:
    """LRU as the live run does it: ``engine_calls`` through a ``StoreModel``."""
    model = run_calls(engine_calls(log, hash_layers, release), slots)
    return _result("lru", slots, model.counts.hits, model.counts.requests, expert_bytes)


# ---- a sweep -------------------------------------------------------------------------


def simulate(
    log: np.ndarray,
    slot_counts: Sequence[int],
    policies: Sequence[str] = POLICIES,
    expert_bytes: int = 0,
    hints: str = "engine",
    hash_layers: int = 3,
    lru_share: float = 0.5,
) -> list[SimResult]:
    """Every policy at every cache size, in (slots, policy) order.

    ``hints``: "engine" replays LRU with the engine's prefetch hints (``replay_store``),
    "none" runs plain LRU on the requests. ``lru_share``: the part of the slots that
    pinned+lru leaves to LRU."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise UsageError(f"unknown policy {unknown[0]!r}; choose from {', '.join(POLICIES)}")
    if hints not in ("engine", "none"):
        raise UsageError(f"--hints must be 'engine' or 'none', got {hints!r}")
    ids = key_ids(log).tolist()
    nxt = next_use(ids) if "belady" in policies else None
    out = []
    for slots in slot_counts:
        for p in policies:
            if p == "lru":
                if hints == "engine":
                    r = replay_store(log, slots, hash_layers, "many", expert_bytes)
                else:
                    r = lru(ids, slots, expert_bytes)
            elif p == "pinned":
                r = pinned(ids, slots, 1, expert_bytes)
            elif p == "pinned+lru":
                r = pinned(ids, slots, max(1, min(slots, round(slots * lru_share))), expert_bytes)
            else:
                r = belady(ids, slots, expert_bytes, nxt)
            out.append(r)
    return out


def _check_slots(slots: int) -> None:
    if slots < 1:
        raise ValueError(f"a cache needs at least 1 slot, got {slots}")
