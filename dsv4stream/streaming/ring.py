"""`StreamedTrunk`: the `Trunk` provider that keeps layers 0..p-1 and the head resident and
streams the other layers through two layer slots in their fixed order.

Owns: the ring and `ViewSource`, the `TensorSource` that lets `weights.family.load_block`
build a layer's named weights as views into a slot's bytes.

Ring contract with the engine: layers are asked for in the order 0..n-1, again and again
(one forward pass after another); a streamed layer's weights are valid until the next
`layer()` call, when its slot starts receiving the layer after next. An out-of-order request
still works (it is read at once, and counted), it just does not overlap with compute.
Weights kept past the point where their slot starts receiving another layer raise
LifetimeError when touched (`lifetime.expire`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from ..checkpoint.catalog import Catalog, TensorEntry, linear_of, read_entry, vector_of
from ..checkpoint.config import ModelConfig
from ..checkpoint.tensors import block_names
from ..errors import CheckpointError, InternalError
from ..kernels import QWeight
from ..store.directio import aligned_buffer
from ..weights.family import BlockWeights, TopWeights, load_block, load_top
from ..weights.lifetime import expire
from .layout import TrunkLayout
from .reader import GroupReader
from .rows import RowReader


class ViewSource:
    """A `TensorSource` answered with views into one slot's bytes: building named weights copies
    nothing (BF16 norms become float32, a few KB)."""

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

    def has(self, name: str) -> bool:
        return name in self._entries

    def qweight(self, prefix: str) -> QWeight:
        return linear_of(self, prefix)

    def f32(self, name: str) -> np.ndarray:
        return vector_of(self, name)


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
        head_mapped: Mapping[str, tuple[TensorEntry, np.ndarray]] | None = None,
    ) -> None:
        cfg = self.cfg = cat.config
        # wrap: serves matrices placed in VRAM (--gpu) in place of the slot's (absent) bytes
        self._wrap = wrap or (lambda src: src)
        self.layout = layout
        self.pinned = min(pinned, cfg.n_layers)
        self._reader = reader
        self._pinned: list[BlockWeights] = []
        for i in range(self.pinned):
            g = layout.layers[i]
            self._pinned.append(self._build(i, reader.read(g, aligned_buffer(g.nbytes))))
        g = layout.head
        arrays, entries = reader.read(g, aligned_buffer(g.nbytes)), dict(g.entries)
        # head_mapped: head tensors the layout leaves out, served from a read-only map of their file
        for name, (e, a) in (head_mapped or {}).items():
            entries[name], arrays[name] = e, a
        self._head = load_top(self._wrap(ViewSource(cfg, entries, arrays)))
        self._tid2eid = {}
        for i in range(min(cfg.num_hash_layers, cfg.n_layers)):
            if i < self.pinned:
                self._tid2eid[i] = self._pinned[i].moe.tid2eid
            else:
                name = block_names(cfg, i)["moe.tid2eid"]
                self._tid2eid[i] = np.ascontiguousarray(read_entry(layout.layers[i].entries[name]), dtype=np.int64)
        self._embed = RowReader(layout.embed, reader.same_file)
        self._opened_reads, self._opened_bytes = reader.reads, reader.bytes_read
        streamed = cfg.n_layers - self.pinned
        size = slot_bytes or max((g.nbytes for g in layout.layers[self.pinned :]), default=0)
        self._slots = [aligned_buffer(size) for _ in range(2)] if streamed else []
        self._tags: list[int | None] = [None, None]
        self._built: list[BlockWeights | None] = [None, None]
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

    def head(self) -> TopWeights:
        return self._head

    def use_head_q8(self, q8) -> None:
        """Give the head the pack's int8 copy (`kernels.head.Int8Head`), which fast numerics reads."""
        self._head = replace(self._head, q8=q8)

    def use_int8_trunk(self) -> None:
        """Turn the pinned layers' FP8 weights into their int8 form in place (`trunkq8`: a fast
        engine on a CPU without a BF16 dot product); streamed layers stay FP8 (their slots are
        refilled every pass: converting them would cost each pass a read of their bytes)."""
        from ..kernels import trunkq8

        for w in self._pinned:
            trunkq8.convert_block(w)

    def tid2eid(self, i: int) -> np.ndarray:
        """(vocab, k) int64 expert table of hash layer i, without loading the layer."""
        return self._tid2eid[i]

    def layer(self, i: int) -> BlockWeights:
        if i < self.pinned:
            return self._pinned[i]
        s = self._slot_of(i)
        if s is None:
            self._out_of_order += 1
            s = 0 if self._current is None else 1 - self._current
            self._start(s, i)
        t0 = time.perf_counter()
        fut = self._futures[s]
        if fut is None:
            raise InternalError(f"ring slot {s} holds layer {i} but no read of it was started")
        try:
            fut.result()
        finally:
            self._wait_seconds += time.perf_counter() - t0
        w = self._built[s]
        if w is None:
            raise InternalError(f"the read of layer {i} finished without building its weights")
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

    @property
    def bytes_read(self) -> int:
        """Bytes of streamed layers read since opening, counting the reads that have landed;
        unlike stats() it waits for nothing (a live display's figure)."""
        return self._reader.bytes_read - self._opened_bytes

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
            expire(
                old,
                f"layer {self._tags[s]}'s weights used after the ring started reading layer {i} into"
                " their slot (a streamed layer is valid until the next layer() call)",
            )
        self._tags[s] = i
        self._built[s] = None
        if self._pool is None:
            raise InternalError(f"layer {i} asked of a ring with no streamed layers")
        self._futures[s] = self._pool.submit(self._load, s, i)

    def _load(self, s: int, i: int) -> None:
        # (ring thread) the slot's previous layer is no longer used: the engine asked for the next one
        arrays = self._reader.read(self.layout.layers[i], self._slots[s])
        self._built[s] = self._build(i, arrays)

    def _build(self, i: int, arrays: Mapping[str, np.ndarray]) -> BlockWeights:
        return load_block(self._wrap(ViewSource(self.cfg, self.layout.layers[i].entries, arrays)), i)
