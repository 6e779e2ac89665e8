"""Streaming weight providers: routed experts from the ExpertStore, dense layers through a ring.

Owns: the byte layouts of the trunk's groups (each main layer, the head, the embedding) in
the packed trunk or straight in the shards; `StreamedExperts`, the `Experts` provider that
pins one expert at a time in an `ExpertStore`; `StreamedTrunk`, the `Trunk` provider that
keeps layers 0..p-1 and the head resident and streams the other layers through two layer
slots in their fixed order; `ViewSource`, the catalog look-alike that lets
`model.weights.load_layer` build a layer's named weights as views into a slot's bytes.
It does not own the split of the budget (`planner`) or the run itself (`runtime`).

Pin contract with the MoE (`model.moe.routed_experts`): a layer's experts come through
`get_many(layer, experts)`, the store's `get_many`: those in memory first, then misses as
their reads land, at most the unpinned slots pinned at once, each expert's computation
finished before the iterator advances. The single `get(layer, e)` keeps the older contract
(the previous expert is released when the next one is asked for). Weights used past either
end raise LifetimeError (`lifetime.expire`).

Ring contract with the engine: layers are asked for in the order 0..n-1, again and again
(one forward pass after another); a streamed layer's weights are valid until the next
`layer()` call, when its slot starts receiving the layer after next. An out-of-order request
still works (it is read at once, and counted), it just does not overlap with compute.
Weights kept past the point where their slot starts receiving another layer raise
LifetimeError when touched.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .catalog import NP_DTYPE, Catalog, TensorEntry, read_entry
from .config import ModelConfig
from .errors import CheckpointError, Dsv4Error, ReadError
from .formats import bf16_to_f32
from .lifetime import expire
from .model.moe import ExpertWeights
from .model.providers import ExpertKey
from .model.weights import HeadWeights, LayerWeights, expert_from_arrays, load_head, load_layer
from .spec import block_specs, model_specs
from .store import ExpertStore, Layout, Piece, merge_pieces
from .store.directio import ALIGN, FileSet, SlotPlan, aligned_buffer, piece_views, plan_slot
from .store.runs import layout_pieces
from .store.verify import Part, Verifier
from .trunkfile import TrunkFile

# Neighbouring tensors closer than this are read in one window (the packed trunk pads
# tensors to 64 bytes; in the shards it merges a layer's small tensors).
MERGE_GAP = ALIGN
VERIFY_CHUNK = 16 << 20  # bytes the verifier re-reads and compares at a time

HEAD_NAMES = ("norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")


# ---- byte layouts of the trunk ---------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """One trunk group read as a unit: its tensors as a store layout and its slot plan."""

    label: str
    layout: Layout
    plan: SlotPlan
    entries: dict[str, TensorEntry]  # name -> where the bytes are (shard or trunk.bin)

    @property
    def nbytes(self) -> int:
        """Slot bytes the group needs (aligned windows included)."""
        return self.plan.nbytes


@dataclass(frozen=True)
class TrunkLayout:
    """Where every resident or streamed trunk tensor is: per main layer, the head, the embedding."""

    layers: tuple[Group, ...]
    head: Group
    embed: TensorEntry
    packed: bool  # True when any group comes from a packed trunk

    @property
    def layer_bytes(self) -> tuple[int, ...]:
        return tuple(g.nbytes for g in self.layers)


def _group(label: str, entries: Mapping[str, TensorEntry]) -> Group:
    located = [
        (e.path, Piece(e.name, e.offset, e.nbytes, np.dtype(NP_DTYPE[e.dtype]), e.shape)) for e in entries.values()
    ]
    layout = merge_pieces(located, MERGE_GAP)
    return Group(label, layout, plan_slot(layout), dict(entries))


def trunk_layout(cat: Catalog, trunk: TrunkFile | None = None, exclude: frozenset[str] = frozenset()) -> TrunkLayout:
    """Groups of the checkpoint's trunk; tensors the pack holds come from it, the rest from the
    shards; `exclude` names tensors that live elsewhere (in VRAM with --gpu) and are never read."""
    cfg = cat.config

    def locate(name: str) -> TensorEntry:
        if trunk is not None and trunk.has(name):
            t = trunk.entry(name)
            return TensorEntry(name, trunk.path, t.offset, t.nbytes, t.dtype, t.shape)
        return cat.entry(name)

    def present(names: Iterable[str]) -> dict[str, TensorEntry]:
        # a scale exists only for quantized weights: the catalog's validation decided which
        return {n: locate(n) for n in names if n in cat.entries and n not in exclude}

    layers = tuple(
        _group(f"layer {i}", present(s.name for s in block_specs(cfg, i, with_experts=False)))
        for i in range(cfg.n_layers)
    )
    head_names = [*HEAD_NAMES, *(s.name for s in model_specs(cfg, with_experts=False) if s.role == "head")]
    head = _group("head", present(head_names))
    packed = trunk is not None and any(e.path == trunk.path for g in (*layers, head) for e in g.entries.values())
    return TrunkLayout(layers, head, locate("embed.weight"), packed)


# ---- views of a slot as a catalog ------------------------------------------------------


class ViewSource:
    """What `load_layer` / `load_head` call on a catalog (config, entry, read, qweight, f32),
    answered with views into one slot's bytes: building named weights copies nothing
    (BF16 norms become float32, a few KB)."""

    # The catalog's own translation from (dtype, shape) to QWeight / float32: one place only.
    qweight = Catalog.qweight
    f32 = Catalog.f32

    def __init__(self, config: ModelConfig, entries: Mapping[str, TensorEntry], arrays: Mapping[str, np.ndarray]):
        self.config = config
        self._entries = entries
        self._arrays = arrays

    def entry(self, name: str) -> TensorEntry:
        e = self._entries.get(name)
        if e is None:
            raise CheckpointError(
                f"tensor '{name}' is missing from the trunk group being loaded; the checkpoint is incomplete"
            )
        return e

    def read(self, name: str) -> np.ndarray:
        self.entry(name)
        return self._arrays[name]


# ---- reading groups ----------------------------------------------------------------------


class GroupReader:
    """Reads a group's aligned windows into a buffer (O_DIRECT unless refused or --io buffered),
    optionally re-reading every tensor through the independent Verifier; counts bytes and time."""

    def __init__(self, io: str, verify: bool, warn: Callable[[str], None] | None = None) -> None:
        self.files = FileSet(io, warn)
        self._verifier = Verifier() if verify else None
        self._lock = threading.Lock()
        self.reads = 0
        self.bytes_read = 0
        self.read_seconds = 0.0
        self.verified_reads = 0
        # check(path, file offset, bytes): the packed trunk's cheap checksum of whole runs read
        self.check: Callable[[str, int, np.ndarray], None] | None = None

    def read(self, group: Group, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Fill `buf` (ALIGN-aligned, at least group.nbytes) and return name -> view."""
        t0 = time.perf_counter()
        n = 0
        try:
            for window in group.plan.windows:
                n += self.files.read(window, buf)
                if self.check is not None:
                    self.check(
                        window.path, window.file_offset, buf[window.slot_offset : window.slot_offset + window.nbytes]
                    )
        except Dsv4Error as e:
            raise type(e)(f"{group.label}: {e}") from e
        views = piece_views(buf, group.layout, group.plan)
        if self._verifier is not None:
            self._verifier.check(group.label, _verify_chunks(group.layout, views))
        with self._lock:
            self.reads += 1
            self.bytes_read += n
            self.read_seconds += time.perf_counter() - t0
            self.verified_reads += self._verifier is not None
        return {p.name: v for p, v in zip(layout_pieces(group.layout), views, strict=True)}

    def close(self) -> None:
        self.files.close()
        if self._verifier is not None:
            self._verifier.close()


def _verify_chunks(layout: Layout, views: Sequence[np.ndarray]) -> list[Part]:
    """The same bytes cut into parts of at most VERIFY_CHUNK, so that re-reading a 1 GB head
    costs VERIFY_CHUNK of memory, not three copies of it."""
    parts = []
    flat = [(run.path, p) for run in layout for p in run.pieces]
    for (path, p), v in zip(flat, views, strict=True):
        if p.nbytes <= VERIFY_CHUNK:
            parts.append(Part(path, p.name, 0, p.offset, v))
            continue
        raw = v.reshape(-1).view(np.uint8)
        for a in range(0, p.nbytes, VERIFY_CHUNK):
            parts.append(Part(path, p.name, a, p.offset + a, raw[a : a + VERIFY_CHUNK]))
    return parts


# ---- providers ---------------------------------------------------------------------------


class StreamedExperts:
    """`Experts` provider over an ExpertStore keyed (layer, expert) with the six arrays in
    `EXPERT_TENSORS` order. Holds at most one pin (see the module doc)."""

    def __init__(self, store: ExpertStore, cfg: ModelConfig) -> None:
        self.store = store
        self.cfg = cfg
        self._held: ExpertKey | None = None
        self._held_weights: ExpertWeights | None = None

    def get(self, layer: int, expert: int) -> ExpertWeights:
        self.release()  # the previous expert's computation is finished (MoE contract)
        key = (layer, expert)
        arrays = self.store.get(key)
        self._held = key
        self._held_weights = expert_from_arrays(self.cfg, tuple(arrays))
        return self._held_weights

    def get_many(self, layer: int, experts: Sequence[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """Each expert once: resident ones first, then misses in the order their reads land."""
        self.release()
        many = getattr(self.store, "get_many", None)
        if many is None:  # a store with get/release only: one at a time, in order
            for e in experts:
                yield e, self.get(layer, e)
            self.release()
            return
        for (_, e), arrays in many([(layer, e) for e in experts]):
            w = expert_from_arrays(self.cfg, tuple(arrays))
            try:
                yield e, w
            finally:
                expire(w, f"layer {layer} expert {e}'s weights used after get_many moved on (valid until it advances)")

    def prefetch(self, keys: Sequence[ExpertKey]) -> None:
        self.store.prefetch(list(keys))

    def release(self) -> None:
        """Unpin the expert handed out last (also done by the next get)."""
        if self._held is not None:
            key, self._held = self._held, None
            expire(self._held_weights, f"layer {key[0]} expert {key[1]}'s weights used after their release"
                   " (one expert is pinned at a time: the next get releases the previous)")  # fmt: skip
            self._held_weights = None
            self.store.release(key)


@dataclass(frozen=True)
class RingStats:
    pinned_layers: int
    streamed_layers: int
    reads: int  # group reads after opening (streamed layers)
    bytes_read: int
    wait_seconds: float  # time layer() blocked on a read: trunk I/O not hidden
    out_of_order: int  # layer() calls that did not follow the fixed order
    verified_reads: int


class StreamedTrunk:
    """`Trunk` provider: layers 0..pinned-1 and the head resident, the rest streamed through
    two slots in fixed order (layer i+1 read while layer i computes); embedding rows read
    on demand; hash layers' tid2eid resident so routing never needs a streamed layer."""

    def __init__(
        self,
        cat: Catalog,
        layout: TrunkLayout,
        pinned: int,
        reader: GroupReader,
        slot_bytes: int | None = None,
        wrap: Callable[[ViewSource], object] | None = None,
    ) -> None:
        cfg = self.cfg = cat.config
        # wrap: serves matrices placed in VRAM (--gpu) in place of the slot's (absent) bytes
        self._wrap = wrap or (lambda src: src)
        self.layout = layout
        self.pinned = min(pinned, cfg.n_layers)
        self._reader = reader
        self._pinned: list[LayerWeights] = []
        for i in range(self.pinned):
            g = layout.layers[i]
            self._pinned.append(self._build(i, reader.read(g, aligned_buffer(g.nbytes))))
        g = layout.head
        self._head = load_head(self._wrap(ViewSource(cfg, g.entries, reader.read(g, aligned_buffer(g.nbytes)))))
        self._tid2eid = {}
        for i in range(min(cfg.num_hash_layers, cfg.n_layers)):
            if i < self.pinned:
                self._tid2eid[i] = self._pinned[i].moe.tid2eid
            else:
                name = f"layers.{i}.ffn.gate.tid2eid"
                self._tid2eid[i] = np.ascontiguousarray(read_entry(layout.layers[i].entries[name]), dtype=np.int64)
        self._embed = _RowReader(layout.embed)
        self._opened_reads, self._opened_bytes = reader.reads, reader.bytes_read
        streamed = cfg.n_layers - self.pinned
        size = slot_bytes or max((g.nbytes for g in layout.layers[self.pinned :]), default=0)
        self._slots = [aligned_buffer(size) for _ in range(2)] if streamed else []
        self._tags: list[int | None] = [None, None]
        self._built: list[LayerWeights | None] = [None, None]
        self._futures: list[Future | None] = [None, None]
        self._current: int | None = None  # slot handed out last
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-ring") if streamed else None
        self._wait_seconds = 0.0
        self._out_of_order = 0
        if streamed:
            self._start(0, self.pinned)  # the first forward pass finds its first streamed layer loading

    # -- Trunk protocol --------------------------------------------------------------------

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        """token_ids (T,) -> (T, D) float32, reading only those rows."""
        return self._embed.rows(np.asarray(token_ids, dtype=np.int64))

    def head(self) -> HeadWeights:
        return self._head

    def tid2eid(self, i: int) -> np.ndarray:
        """(vocab, k) int64 expert table of hash layer i, without loading the layer."""
        return self._tid2eid[i]

    def layer(self, i: int) -> LayerWeights:
        if i < self.pinned:
            return self._pinned[i]
        s = self._slot_of(i)
        if s is None:
            self._out_of_order += 1
            s = 0 if self._current is None else 1 - self._current
            self._start(s, i)
        t0 = time.perf_counter()
        fut = self._futures[s]
        assert fut is not None
        try:
            fut.result()
        finally:
            self._wait_seconds += time.perf_counter() - t0
        w = self._built[s]
        assert w is not None
        self._current = s
        nxt = self.pinned + (i + 1 - self.pinned) % (self.cfg.n_layers - self.pinned)
        if self._slot_of(nxt) is None:
            self._start(1 - s, nxt)
        return w

    # -- stats and lifetime ----------------------------------------------------------------

    @property
    def wait_seconds(self) -> float:
        """Time layer() has blocked on reads so far; unlike stats() it waits for nothing."""
        return self._wait_seconds

    def stats(self) -> RingStats:
        # A read of the next layer may still be in flight: let it land so that the counts do
        # not depend on timing (it is the read the next forward pass would wait for anyway).
        for fut in self._futures:
            if fut is not None:
                fut.exception()
        r = self._reader
        return RingStats(
            pinned_layers=self.pinned,
            streamed_layers=self.cfg.n_layers - self.pinned,
            reads=r.reads - self._opened_reads,
            bytes_read=r.bytes_read - self._opened_bytes,
            wait_seconds=self._wait_seconds,
            out_of_order=self._out_of_order,
            verified_reads=r.verified_reads,
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._embed.close()
        self._reader.close()

    # -- internals -------------------------------------------------------------------------

    def _slot_of(self, i: int) -> int | None:
        for s in (0, 1):
            if self._tags[s] == i:
                return s
        return None

    def _start(self, s: int, i: int) -> None:
        """Queue the read of layer i into slot s (after whatever the reader thread has queued)."""
        old = self._built[s]
        if old is not None:
            expire(old, f"layer {self._tags[s]}'s weights used after the ring started reading layer {i} into"
                   " their slot (a streamed layer is valid until the next layer() call)")  # fmt: skip
        self._tags[s] = i
        self._built[s] = None
        assert self._pool is not None
        self._futures[s] = self._pool.submit(self._load, s, i)

    def _load(self, s: int, i: int) -> None:
        # (ring thread) the slot's previous layer is no longer used: the engine asked for the next one
        arrays = self._reader.read(self.layout.layers[i], self._slots[s])
        self._built[s] = self._build(i, arrays)

    def _build(self, i: int, arrays: Mapping[str, np.ndarray]) -> LayerWeights:
        return load_layer(self._wrap(ViewSource(self.cfg, self.layout.layers[i].entries, arrays)), i)


class _RowReader:
    """Rows of a 2-D tensor (the embedding) read on demand with pread: (T,) ids -> (T, D) float32."""

    def __init__(self, e: TensorEntry) -> None:
        self.e = e
        self.dtype = np.dtype(NP_DTYPE[e.dtype])
        self.row_bytes = int(np.prod(e.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self.fd = os.open(e.path, os.O_RDONLY)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        e = self.e
        out = np.empty((len(ids), *e.shape[1:]), dtype=self.dtype)
        for j, r in enumerate(ids):
            if not 0 <= r < e.shape[0]:
                raise CheckpointError(f"'{e.name}': row {r} outside 0..{e.shape[0] - 1}")
            try:
                b = os.pread(self.fd, self.row_bytes, e.offset + int(r) * self.row_bytes)
            except OSError as err:
                raise ReadError(f"{e.path}: {err.strerror} reading '{e.name}' row {r}; check the disk") from None
            if len(b) != self.row_bytes:
                raise ReadError(f"{e.path}: short read of '{e.name}' row {r}; the file is truncated")
            out[j] = np.frombuffer(b, dtype=self.dtype).reshape(e.shape[1:])
        return bf16_to_f32(out) if e.dtype == "BF16" else out.astype(np.float32)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
