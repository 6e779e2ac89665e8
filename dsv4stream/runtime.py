"""A budgeted run: open a checkpoint under `--budget`, generate tokens, collect statistics.

Owns: measuring what the process must hold from the actual checkpoint (`memory_needs`:
layer and head groups as they are read, the expert slot size, state and staging
estimates, the measured baseline overhead), planning it (`planner.plan`), wiring the
streaming providers (`streaming`) into an `Engine`, the generation loop (`Runtime.generate`,
a generator that also prefetches the hash layers' experts the moment a token is chosen),
and the figures of a run (`RunStats`). The CLI (`commands/run.py`), the demo and the benches
go through `Runtime`; the math stays in `engine` / `model`.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Self

import numpy as np

from . import kernels, planner
from .catalog import Catalog
from .engine import Engine, LayerHook, PrefillStep, Session
from .errors import UsageError
from .kernels import reference
from .pack import MANIFEST, default_out_dir
from .planner import MemoryNeeds, Plan
from .store import ExpertStore
from .store.layout import expert_label, expert_layouts
from .streaming import GroupReader, StreamedExperts, StreamedTrunk, TrunkLayout, trunk_layout
from .trunkfile import TrunkFile

Pick = Callable[[np.ndarray], int]
Warn = Callable[[str], None]


@dataclass(frozen=True)
class RunOptions:
    """What a run may use. `budget` in bytes; `trunk`: a packed trunk directory, None for the
    default one when it exists (CHECKPOINT/dsv4-trunk), or "" to read the shards only."""

    budget: int
    io: str = "direct"
    verify: bool = False
    threads: int | None = None  # kernel threads
    io_threads: int = 4  # expert reader threads (queue depth)
    trunk: str | os.PathLike | None = None
    route_log: str | os.PathLike | IO[str] | None = None
    ctx: int = 4096  # longest sequence the state estimate covers
    chunk: int = planner.SUB_CHUNK  # attention sub-chunk of a prefill segment
    overhead: int = planner.DEFAULT_OVERHEAD
    prefill_segment: int | None = None  # tokens per prefill segment (None: the planner's choice)


@dataclass(frozen=True)
class RunStats:
    """Figures of a run so far (JSON-ready through `as_dict`). Bytes are as read from disk."""

    generated_ids: list[int]
    prompt_tokens: int
    expert_requests: int
    expert_hits: int
    expert_misses: int
    expert_evictions: int
    expert_prefetches: int
    prefetch_used: int
    hit_rate: float
    bytes_read: int  # routed experts
    read_seconds: float  # wall time with an expert read in flight
    read_gbps: float
    exposed_io_seconds: float  # time the forward blocked on expert reads: I/O not hidden
    verified_reads: int
    verify_mismatches: int
    cache_slots: int
    slot_bytes: int
    working_set_experts: int
    trunk_pinned_layers: int
    trunk_streamed_layers: int
    trunk_reads: int
    trunk_bytes_read: int
    trunk_wait_seconds: float
    trunk_out_of_order: int  # layer requests that broke the fixed order (read without overlap)
    trunk_verified_reads: int
    peak_rss_bytes: int
    budget_bytes: int
    planned_bytes: int
    io_mode: str
    io_fallback_files: int
    kernel_backend: str
    prefill_seconds: float
    decode_tokens: int
    decode_seconds_per_token: float  # decode only: prefill excluded
    prefill_tokens_per_second: float
    # one entry per `generate` call (a chat turn): tokens prefilled, seconds to its first token
    turn_prompt_tokens: list[int] = field(default_factory=list)
    first_token_seconds: list[float] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    kernel_warmup_seconds: float = 0.0  # compiling or loading the kernels (numba cache), at open
    prefill_segment: int = 0  # tokens per prefill segment the run used
    prefill_stopped: str = ""  # where an interrupted prefill stopped ("" when none was)

    def as_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """A short human summary."""
        gb = 1e9
        out = [
            (
                f"experts: {self.expert_requests} requests, {self.expert_hits} hits ({self.hit_rate:.1%}),"
                f" {self.expert_misses} misses, {self.bytes_read / gb:.3f} GB read at {self.read_gbps:.2f} GB/s,"
                f" {self.exposed_io_seconds:.2f} s waiting on reads; cache {self.cache_slots} slots"
                f" (working set {self.working_set_experts})"
            ),
            f"trunk: {self.trunk_pinned_layers} layers pinned, {self.trunk_streamed_layers} streamed"
            + (
                f" ({self.trunk_reads} reads, {self.trunk_bytes_read / gb:.3f} GB, {self.trunk_wait_seconds:.2f} s waiting)"
                if self.trunk_streamed_layers
                else ""
            ),
            (
                f"time: prefill {self.prompt_tokens} tokens in {self.prefill_seconds:.2f} s,"
                f" decode {self.decode_seconds_per_token:.3f} s/token over {self.decode_tokens} tokens"
                f" (kernels: {self.kernel_backend}, ready in {self.kernel_warmup_seconds:.2f} s)"
            ),
            f"memory: peak RSS {self.peak_rss_bytes / gb:.3f} GB of --budget {self.budget_bytes / gb:.3f} GB"
            + (
                f"; verified {self.verified_reads} expert reads, {self.verify_mismatches} mismatches"
                if self.verified_reads
                else ""
            ),
        ]
        return out + [f"warning: {w}" for w in self.warnings]


def peak_rss_bytes() -> int:
    """This process's peak resident set (the kernel's VmHWM, in bytes).

    Not getrusage's ru_maxrss: across fork + exec that figure keeps the parent's peak (the
    pre-exec address space is the parent's), so a run started from a large process (a test
    runner, `dsv4 bench`) would report the parent's memory as its own."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def kernel_scratch_bytes(cat: Catalog) -> int:
    """Float32 scratch the kernels allocate for the largest linear (the numpy reference
    dequantises row blocks; the fused backend's tile buffers are part of the overhead)."""
    if kernels.backend_name() != "reference":
        return 0
    most = 0
    for e in cat.entries.values():
        if len(e.shape) == 2 and e.dtype in ("F8_E4M3", "I8", "BF16", "F32"):
            cols = e.shape[1] * (2 if e.dtype == "I8" else 1)
            most = max(most, reference.scratch_bytes(e.shape[0], cols))
    return most


def memory_needs(cat: Catalog, layout: TrunkLayout, slot_bytes: int, opts: RunOptions) -> MemoryNeeds:
    """What the plan must place, measured on this checkpoint (layer groups as read, with
    their aligned windows), plus the state / staging estimates and the baseline overhead."""
    cfg = cat.config
    return MemoryNeeds(
        layer_bytes=layout.layer_bytes,
        head_bytes=layout.head.nbytes + cfg.tid2eid_bytes,
        slot_bytes=slot_bytes,
        state_bytes=planner.state_bytes_for(cfg, opts.ctx),
        staging_bytes=planner.staging_bytes_for(cfg, opts.chunk, opts.ctx) + kernel_scratch_bytes(cat),
        overhead_bytes=opts.overhead,
        working_set=cfg.working_set_experts,
        experts_per_token=cfg.num_experts_per_tok,
        total_experts=cfg.n_layers * cfg.n_routed_experts,
        segment_token_bytes=planner.segment_token_bytes(cfg),
        segment_min=opts.chunk,
        segment=opts.prefill_segment,
    )


def _expert_layouts(cat: Catalog) -> tuple[dict, dict]:
    """Store layouts and piece orders of the main layers' experts (the MTP block is not run)."""
    n = cat.config.n_layers
    el = expert_layouts(cat.entries, n)
    layouts = {k: v for k, v in el.layouts.items() if k[0] < n}
    return layouts, {k: el.order[k] for k in layouts}


def measure(checkpoint: str | os.PathLike, opts: RunOptions) -> MemoryNeeds:
    """MemoryNeeds of this checkpoint as `Runtime.open` would plan it (reads headers only)."""
    cat = Catalog.open(checkpoint)
    tf = open_trunk_file(cat, opts.trunk)
    layouts, _ = _expert_layouts(cat)
    return memory_needs(cat, trunk_layout(cat, tf), ExpertStore.slot_nbytes(layouts), opts)


def open_trunk_file(cat: Catalog, trunk: str | os.PathLike | None) -> TrunkFile | None:
    """The packed trunk to read from: the one named, else the default one if packed, else None."""
    if trunk == "":
        return None
    if trunk is None:
        default = default_out_dir(cat.root)
        if not (default / MANIFEST).is_file():
            return None
        trunk = default
    return TrunkFile.open(trunk, cat)


class _Once:
    """Pass each distinct message to `warn` once (the trunk and the store share the notice)."""

    def __init__(self, warn: Warn | None) -> None:
        self.warn = warn
        self.seen: set[str] = set()

    def __call__(self, msg: str) -> None:
        key = msg.split(" of ", 1)[0]
        if self.warn is not None and key not in self.seen:
            self.seen.add(key)
            self.warn(msg)


class Runtime:
    """An Engine whose trunk and experts stream from disk within a planned budget."""

    def __init__(
        self,
        cat: Catalog,
        opts: RunOptions,
        plan: Plan,
        engine: Engine,
        store: ExpertStore,
        trunk: StreamedTrunk,
        trunk_file: TrunkFile | None,
    ) -> None:
        self.cat = cat
        self.cfg = cat.config
        self.opts = opts
        self.plan = plan
        self.engine = engine
        self.store = store
        self.trunk = trunk
        self.trunk_file = trunk_file
        self.experts: StreamedExperts = engine.experts  # type: ignore[assignment]
        self._generated: list[int] = []
        self._prompt_tokens = 0
        self._prefill_seconds = 0.0
        self._decode_seconds = 0.0
        self._decode_tokens = 0
        self.kernel_warmup_seconds = 0.0
        self._turn_prompt_tokens: list[int] = []
        self._first_token_seconds: list[float] = []
        self._prefill_stopped = ""

    @classmethod
    def open(cls, checkpoint: str | os.PathLike, opts: RunOptions, warn: Warn | None = None, gpu=None) -> Runtime:
        """Plan `opts.budget` on this checkpoint (BudgetError if it cannot work) and load what
        the plan keeps resident. `warn` receives one-time notices (O_DIRECT refused); `gpu`
        (a `dsv4stream.gpu.GpuContext`) moves trunk matrices to VRAM, out of the budget."""
        if opts.io not in ("direct", "buffered"):
            raise UsageError(f"--io {opts.io!r}: use direct or buffered")
        if opts.chunk < 1 or opts.ctx < 1:
            raise UsageError(f"chunk and ctx must be at least 1, found {opts.chunk} and {opts.ctx}")
        if opts.prefill_segment is not None and opts.prefill_segment < 1:
            raise UsageError(f"--prefill-segment {opts.prefill_segment}: give at least 1 token")
        cat = Catalog.open(checkpoint)
        cat.validate()
        cfg = cat.config
        once = _Once(warn)
        tf = open_trunk_file(cat, opts.trunk)
        placed = gpu.place(cat) if gpu is not None and gpu.enabled else None
        layout = trunk_layout(cat, tf, exclude=placed.tensor_names if placed is not None else frozenset())
        layouts, order = _expert_layouts(cat)
        if gpu is not None and gpu.enabled:
            # the CUDA context, CuPy and pinned activation buffers are host memory too
            d = cfg.hidden_size
            widest = max(cfg.num_attention_heads * cfg.head_dim, cfg.vocab_size, d)
            opts = replace(
                opts, overhead=opts.overhead + gpu.host_bytes + gpu.staging_bytes(widest, widest, opts.chunk)
            )
        needs = memory_needs(cat, layout, ExpertStore.slot_nbytes(layouts), opts)
        plan = planner.plan(needs, opts.budget)
        if tf is None and opts.trunk != "":
            once(
                f"no packed trunk in {default_out_dir(cat.root)}: reading the trunk from the shards;"
                f" `dsv4 pack-trunk {cat.root}` once makes start-up faster"
            )
        if opts.threads is not None:
            kernels.set_threads(opts.threads)
        if kernels.backend_name() == "fast" and not kernels.compiled_cache_exists():
            once("compiling the numba kernels (once per installation, about 40 s; cached after)")
        warmup_seconds = kernels.warmup()
        store = ExpertStore(
            layouts,
            plan.expert_slots,
            io=opts.io,
            threads=opts.io_threads,
            verify=opts.verify,
            route_log=opts.route_log,
            label=expert_label,
            warn=once,
            order=order,
        )
        try:
            reader = GroupReader(opts.io, opts.verify, once)
            wrap = placed.source if placed is not None else None
            trunk = StreamedTrunk(cat, layout, plan.pinned_layers, reader, plan.ring_slot_bytes or None, wrap)
        except BaseException:
            store.close()
            raise
        engine = Engine(cfg, trunk, StreamedExperts(store, cfg), cat)
        rt = cls(cat, opts, plan, engine, store, trunk, tf)
        rt.kernel_warmup_seconds = warmup_seconds
        return rt

    # -- generation --------------------------------------------------------------------------

    def session(self, **kw) -> Session:
        """A session with this run's sub-chunk and planned prefill segment (kw: `Engine.session`'s hooks)."""
        return self.engine.session(chunk_size=self.opts.chunk, segment=self.plan.prefill_segment, **kw)

    def prefetch_hash_layers(self, token_ids: Sequence[int]) -> None:
        """Start reading the hash layers' experts for these tokens: exact, known from the ids alone."""
        ids = np.asarray(token_ids, dtype=np.int64)
        keys = []
        for i in range(min(self.cfg.num_hash_layers, self.cfg.n_layers)):
            keys += [(i, int(e)) for e in np.unique(self.trunk.tid2eid(i)[ids])]
        if keys:
            self.experts.prefetch(keys)

    def generate(
        self,
        session: Session,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        pick: Pick | None = None,
        stop_ids: Sequence[int] = (),
        progress: Callable[[int, int], None] | None = None,
        on_layer: LayerHook | None = None,
    ) -> Iterator[int]:
        """Prefill `prompt_ids`, then yield up to `max_new_tokens` tokens chosen by `pick`
        (default greedy, ties to the lower id), stopping after a token in `stop_ids`.

        Every yielded token but the last has been fed to the session; the last one has not
        (no forward pass is spent on logits nobody reads): a later turn starts with it.
        `progress(done, total)` runs after each prefill segment, `on_layer(PrefillStep)` after
        each layer of each segment (raising there stops within one layer). Times go to
        `stats()`: prefill (to the first logits), time to the first token, and decode steps
        separately; a prefill stopped part-way counts the tokens fully fed and says where it
        stopped (`prefill_stopped`)."""
        pick = pick or _greedy
        n_prompt = len(prompt_ids)
        report = (lambda done: progress(done, n_prompt)) if progress is not None else None
        last: list[PrefillStep] = []

        def layer_done(step: PrefillStep) -> None:
            last[:] = [step]
            if on_layer is not None:
                on_layer(step)

        t0 = time.perf_counter()
        pos0 = session.pos
        try:
            logits = session.prefill(prompt_ids, last_only=True, progress=report, on_layer=layer_done)
        except BaseException:
            self._prefill_seconds += time.perf_counter() - t0
            self._prompt_tokens += session.pos - pos0
            if last:
                self._prefill_stopped = (
                    f"{session.pos - pos0} of {n_prompt} tokens fed; stopped after {last[0].where()}"
                )
            raise
        self._prefill_seconds += time.perf_counter() - t0
        self._prompt_tokens += n_prompt
        self._turn_prompt_tokens.append(n_prompt)
        for n in range(max_new_tokens):
            tok = pick(logits)
            if n == 0:
                self._first_token_seconds.append(time.perf_counter() - t0)
            last = n + 1 == max_new_tokens or tok in stop_ids
            if not last:
                # the token is known: its hash-layer experts can load while the caller prints it
                self.prefetch_hash_layers([tok])
            self._generated.append(tok)
            yield tok
            if last:
                return
            t0 = time.perf_counter()
            logits = session.step(tok)
            self._decode_seconds += time.perf_counter() - t0
            self._decode_tokens += 1

    # -- figures and lifetime ----------------------------------------------------------------

    def stats(self) -> RunStats:
        s = self.store.stats()
        r = self.trunk.stats()
        peak = peak_rss_bytes()
        warnings = list(self.plan.warnings)
        if peak > self.opts.budget:
            warnings.append(
                f"peak RSS {peak / 1e9:.3f} GB exceeded --budget {self.opts.budget / 1e9:.3f} GB;"
                " raise --budget or report this run (the plan's estimates were too low)"
            )
        return RunStats(
            generated_ids=list(self._generated),
            prompt_tokens=self._prompt_tokens,
            expert_requests=s.requests,
            expert_hits=s.hits,
            expert_misses=s.misses,
            expert_evictions=s.evictions,
            expert_prefetches=s.prefetches,
            prefetch_used=s.prefetch_used,
            hit_rate=s.hit_rate,
            bytes_read=s.bytes_read,
            read_seconds=s.read_seconds,
            read_gbps=s.read_gbps,
            exposed_io_seconds=s.wait_seconds,
            verified_reads=s.verified_reads,
            verify_mismatches=s.verify_mismatches,
            cache_slots=s.slots,
            slot_bytes=s.slot_bytes,
            working_set_experts=self.cfg.working_set_experts,
            trunk_pinned_layers=r.pinned_layers,
            trunk_streamed_layers=r.streamed_layers,
            trunk_reads=r.reads,
            trunk_bytes_read=r.bytes_read,
            trunk_wait_seconds=r.wait_seconds,
            trunk_out_of_order=r.out_of_order,
            trunk_verified_reads=r.verified_reads,
            peak_rss_bytes=peak,
            budget_bytes=self.opts.budget,
            planned_bytes=self.plan.planned_bytes,
            io_mode=s.io if not s.fallback_files else f"{s.io} (buffered fallback)",
            io_fallback_files=s.fallback_files,
            kernel_backend=kernels.backend_name(),
            kernel_warmup_seconds=self.kernel_warmup_seconds,
            prefill_seconds=self._prefill_seconds,
            decode_tokens=self._decode_tokens,
            decode_seconds_per_token=self._decode_seconds / self._decode_tokens if self._decode_tokens else 0.0,
            prefill_tokens_per_second=self._prompt_tokens / self._prefill_seconds if self._prefill_seconds else 0.0,
            turn_prompt_tokens=list(self._turn_prompt_tokens),
            first_token_seconds=list(self._first_token_seconds),
            warnings=warnings,
            prefill_segment=self.plan.prefill_segment,
            prefill_stopped=self._prefill_stopped,
        )

    def close(self) -> None:
        self.experts.release()
        self.trunk.close()
        self.store.close()
        if self.trunk_file is not None:
            self.trunk_file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def default_budget() -> int:
    """80% of the memory available now (what `--budget` defaults to)."""
    import psutil

    return int(psutil.virtual_memory().available * 0.8)


def budget_bytes(gb: float | None) -> int:
    """--budget GB (decimal) -> bytes; None -> the default."""
    if gb is None:
        return default_budget()
    if not gb > 0:
        raise UsageError(f"--budget {gb}: give a positive number of GB (decimal, e.g. --budget 3)")
    return int(gb * planner.GB)


def checkpoint_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise UsageError(
            f"{p}: not a checkpoint directory (no config.json); pass the folder holding config.json and *.safetensors"
        )
    return p
