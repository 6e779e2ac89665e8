"""A budgeted run: open a checkpoint under `--budget`, generate tokens, collect statistics.

Owns: planning what `memory.memory_needs` measured (`planner.plan`), compiling the kernels
outside the budget, wiring the streaming providers (`streaming`) into an `Engine` with a
meter of their counters, `Runtime.generate` (the session's generation loop, stopped at
--ctx; the session times its own phases), the live counters (`counters`, which wait for
nothing) and the run's figures (`runinfo.RunStats`: the providers' stats and the sessions'
phases, nested). The CLI (`cli/run.py`), the demo and the benches
go through `Runtime`; the math stays in `engine` / `model`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial
from typing import Self

import numpy as np

from .. import kernels
from ..checkpoint.catalog import Catalog
from ..checkpoint.tensors import MODEL
from ..engine.numerics import DEFAULTS as NUMERICS_DEFAULTS
from ..engine.numerics import canonical as canonical_numerics
from ..engine.numerics import kernel_mode as kernel_numerics
from ..engine.numerics import label as numerics_label
from ..engine.phases import Counters
from ..engine.session import Engine, LayerHook, Session
from ..engine.spec_draws import PositionUniforms
from ..engine.spec_memory import SpecMemory
from ..engine.speculation import Speculator, pick_at
from ..engine.stack_v41 import SpanRows
from ..engine.threads import ThreadGovernor
from ..errors import InternalError, UsageError
from ..kernels import cpu as kernel_cpu
from ..kernels.head import Int8Head
from ..store import ExpertStore
from ..streaming.engram import DiskEngramRows
from ..streaming.expert_layout import expert_label
from ..streaming.experts import StreamedExperts
from ..streaming.layout import trunk_layout, without
from ..streaming.mapped import map_entry
from ..streaming.reader import GroupReader
from ..streaming.ring import StreamedTrunk
from ..text.sampler import greedy
from ..trunkpack.packdir import default_out_dir, pack_hint
from ..trunkpack.reader import TrunkFile, open_trunk_file
from . import planner, planner_head
from .compile import checkpoint_forms, compile_kernels_apart
from .memory import (
    HEAD_MATRIX,
    head_q8_bytes_of,
    main_expert_layouts,
    memory_needs,
    peak_rss_bytes,
    recycle_heap,
    runs_drafter,
    trim_heap,
)
from .planner import Plan
from .runinfo import RunOptions, RunStats

Pick = Callable[[np.ndarray], int]
Warn = Callable[[str], None]


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
        engram: DiskEngramRows | None = None,
        warn: Warn | None = None,
    ) -> None:
        self.cat = cat
        self.cfg = cat.config
        self.opts = opts
        self.plan = plan
        self.engine = engine
        self.store = store
        self.trunk = trunk
        self.trunk_file = trunk_file
        self.engram = engram  # V4.1's Engram rows from disk (None: the model has no Engram)
        self.experts: StreamedExperts = engine.experts  # type: ignore[assignment]
        self.kernel_warmup_seconds = 0.0
        self.load_seconds = 0.0
        self.most_lent = 0  # most expert slots lent to a prefill segment at once
        packed = trunk_file is not None
        # auto's figures between runs (`engine.spec_memory`), opened when auto first runs
        memory = lambda: SpecMemory.for_run(_memory_parts(cat, opts, packed, plan), warn)
        self._speculator = Speculator(engine, opts.speculate, memory)  # a bad --speculate fails before any prompt

    @classmethod
    def open(cls, checkpoint: str | os.PathLike, opts: RunOptions, warn: Warn | None = None) -> Runtime:
        """Plan `opts.budget` on this checkpoint (BudgetError if it cannot work) and load what
        the plan keeps resident. `warn` receives one-time notices (O_DIRECT refused); `opts.gpu`
        moves trunk matrices to VRAM, out of the budget. Where the plan takes the pack's int8
        head copy (`planner_head.INT8`), the BF16 head is mapped from its file, not read."""
        if opts.io not in ("direct", "buffered"):
            raise UsageError(f"--io {opts.io!r}: use direct or buffered")
        if opts.chunk < 1 or opts.ctx < 1:
            raise UsageError(f"chunk and ctx must be at least 1, found {opts.chunk} and {opts.ctx}")
        if opts.prefill_segment is not None and opts.prefill_segment < 1:
            raise UsageError(f"--prefill-segment {opts.prefill_segment}: give at least 1 token")
        if opts.numerics is not None:  # a bad name: one line, before loading
            opts = replace(opts, numerics=canonical_numerics(opts.numerics))
        t_open = time.perf_counter()
        gpu = opts.gpu
        cat = Catalog.open(checkpoint)
        cat.validate()
        cfg = cat.config
        once = _Once(warn)
        tf = open_trunk_file(cat, opts.trunk, verify=opts.verify)
        placed = gpu.place(cat) if gpu is not None and gpu.enabled else None
        layout = trunk_layout(cat, tf, exclude=placed.tensor_names if placed is not None else frozenset())
        layouts, order = main_expert_layouts(cat, runs_drafter(cat, opts))
        if gpu is not None and gpu.enabled:
            # the CUDA context, CuPy and pinned activation buffers are host memory too
            d = cfg.hidden_size
            widest = max(cfg.num_attention_heads * cfg.head_dim, cfg.vocab_size, d)
            opts = replace(
                opts, overhead=opts.overhead + gpu.host_bytes + gpu.staging_bytes(widest, widest, opts.chunk)
            )
        head_on_gpu = placed is not None and MODEL["head"] + ".weight" in placed.tensor_names
        q8_bytes = head_q8_bytes_of(tf, cfg.family, opts.numerics, head_on_gpu)
        plan = planner.plan(memory_needs(cat, layout, ExpertStore.slot_nbytes(layouts), opts, q8_bytes), opts.budget)
        head_mode = plan.needs.head_mode
        mapped = {}
        if head_mode == planner_head.INT8:  # the BF16 head stays in its file, mapped (`planner_head`)
            mapped = {n: (layout.head.entries[n], map_entry(layout.head.entries[n])) for n in HEAD_MATRIX}
            layout = replace(layout, head=without(layout.head, HEAD_MATRIX))
        if tf is None and opts.trunk != "":
            once(
                f"no packed trunk in {default_out_dir(cat.root)}: reading the trunk from the shards; {pack_hint(cat.root)}"
            )
        if opts.threads is not None:
            kernels.set_threads(opts.threads)
        # the kernels the engine's numerics reach (its default when none is given), so that a
        # fast run's kernels compile in the children too and not at its first token
        mode = kernel_numerics(cfg.family, opts.numerics or NUMERICS_DEFAULTS[cfg.family])
        forms = checkpoint_forms(cat, mode)
        compile_kernels_apart(forms, once)
        warmup_seconds = kernels.warmup(forms)
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
        engram: DiskEngramRows | None = None
        trunk: StreamedTrunk | None = None
        store.populate()  # the slots' first-touch page faults beside the trunk's reads (see its doc)
        try:
            if cfg.engram is not None:
                # V4.1: the Engram rows from disk into the planned row cache, read on the store's
                # threads; at least one token's rows of one layer fit (the plan's segment floor)
                rows = max(plan.engram_rows, cfg.engram.columns)
                engram = DiskEngramRows(cat, rows, io=opts.io, pool=store.pool, verify=opts.verify, warn=once)
            reader = GroupReader(opts.io, opts.verify, once)
            if tf is not None:
                reader.check, reader.same_file = tf.check_window, tf.check_identity
            wrap = placed.source if placed is not None else None
            trunk = StreamedTrunk(
                cat, layout, plan.pinned_layers, reader, plan.ring_slot_bytes or None, wrap, head_mapped=mapped
            )
            if head_mode == planner_head.INT8:  # fast numerics' logits (and drafts) from the pack's int8 head copy
                trunk.use_head_q8(Int8Head(*tf.read_head_q8()))
            meter = partial(run_counters, store, trunk, engram)
            engine = Engine(
                cfg, trunk, StreamedExperts(store, cfg), cat, engram_rows=engram, meter=meter, numerics=opts.numerics
            )
            if opts.threads is None and kernels.backend_name() == "fast" and kernels.get_threads() > 1:
                engine.governor = ThreadGovernor(kernels.get_threads())
            store.wait_populated()
        except BaseException:
            if trunk is not None:
                trunk.close()
            if engram is not None:
                engram.close()
            store.close()
            raise
        # what loading freed goes back; from here the passes reuse each other's freed activations
        trim_heap()
        recycle_heap()
        rt = cls(cat, opts, plan, engine, store, trunk, tf, engram, once)
        rt.kernel_warmup_seconds = warmup_seconds
        rt.load_seconds = time.perf_counter() - t_open
        return rt

    # -- generation --------------------------------------------------------------------------

    def session(self, **kw) -> Session:
        """A session with this run's sub-chunk and planned prefill segment (kw: `Engine.session`'s hooks),
        whose passes share the plan's pool between expert slots and activations (`make_room`)."""
        return self.engine.session(
            chunk_size=self.opts.chunk, segment=self.plan.prefill_segment, before_pass=self.make_room, **kw
        )

    def make_room(self, tokens: int) -> None:
        """Before a pass of `tokens` tokens: lend the expert slots whose bytes its activations
        need (`Plan.prefill_slots`), or, before a decode step, take them all back (and hand the
        freed activations' heap pages back to the kernel, so that the slots refilling stay
        within the budget)."""
        lend = self.plan.expert_slots - self.plan.prefill_slots(tokens)
        if lend == self.store.lent:
            return
        self.experts.release()  # a single `get`'s pin would hold a slot that may have to go
        back = lend < self.store.lent
        self.store.lend(lend)
        if back:
            trim_heap()
        self.most_lent = max(self.most_lent, lend)

    def generate(
        self,
        session: Session,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        pick: Pick | None = None,
        stop_ids: Sequence[int] = (),
        progress: Callable[[int, int], None] | None = None,
        on_layer: LayerHook | None = None,
        boundaries: Sequence[int] = (),
        logits: np.ndarray | None = None,
        spans: SpanRows | None = None,
        batched: bool = False,
        speculate: str | int | None = None,
        uniforms: PositionUniforms | None = None,
        prompt_read: float | None = None,
    ) -> Iterator[int]:
        """`session.generate` (the one generation loop) within this run: it also stops when the
        session holds `opts.ctx` positions (the context the plan covers is full).

        As there, every yielded token but the last has been fed to the session; a later turn
        starts with the last one; the session times its phases (`Session.turn`, summed in
        `stats()` over every session of this run's engine). `progress(done, total)` runs after
        each prefill segment, `on_layer(PrefillStep)` after each layer of each segment
        (`boundaries`: where a segment must also end, as `Session.prefill`); an exception either
        raises stops the prefill (within one layer from `on_layer`), and the tokens fully fed
        still count, with where it stopped (`prefill_stopped`). `logits`: continue from a
        restored state's logits without a prefill (the server's `n` > 1 choices); `spans`: the
        prompt's V4.1 image spans (`engine.images.image_prompt`); `batched`: the caller steps
        the tokens with others' (`Session.generate`), and nothing is drafted then.

        `speculate`: this call's setting ("off", "auto", N; None: the run's `opts.speculate`),
        through `engine.speculation` (drafts verified in one pass; the same ids as without);
        `uniforms`: the `PositionUniforms` a sampled `pick` draws from, moved to each pick's
        position (with drafts or without, batched or not: the same ids for the same seed);
        `prompt_read`: the caller fed the prompt itself (batched only; `Session.generate`)."""
        report = (lambda done: progress(done, len(prompt_ids))) if progress is not None else None
        setting = self.speculator.resolve(speculate)
        kw = {"stop_ids": stop_ids, "max_pos": self.opts.ctx, "progress": report, "on_layer": on_layer,
              "boundaries": boundaries, "logits": logits, "spans": spans}  # fmt: skip
        if prompt_read is not None and not batched:
            raise InternalError("a prompt fed by the caller goes with batched steps")
        if setting != "off" and not batched:
            return self.speculator.generate(session, setting, prompt_ids, max_new_tokens, pick or greedy,
                                            uniforms=uniforms, **kw)  # fmt: skip
        pick = pick_at(session, pick or greedy, uniforms)
        return session.generate(prompt_ids, max_new_tokens, pick, batched=batched, prompt_read=prompt_read, **kw)

    @property
    def speculator(self) -> Speculator:
        """The run's speculation (`engine.speculation`; the drafter's weights load when it first drafts)."""
        return self._speculator

    @property
    def stop_reason(self) -> str:
        """Why the last generate call ended ("" before the first)."""
        turns = self.engine.phases.turns
        return turns[-1].stop_reason if turns else ""

    def mark_in_think(self) -> None:
        """The last generation ended inside the reasoning (before </think>): for the figures."""
        if self.engine.phases.turns:
            self.engine.phases.turns[-1].in_think = True

    # -- figures and lifetime ----------------------------------------------------------------

    def counters(self) -> Counters:
        """The store's, ring's and Engram cache's counters now, waiting for no read in flight:
        what live displays show (the prefill bar, the server's /v1/stats and /metrics)."""
        return run_counters(self.store, self.trunk, self.engram)

    def stats(self) -> RunStats:
        """The run's figures: the store's, ring's and Engram cache's stats and the sessions'
        phases, nested (`RunStats`); the ring's wait for a read in flight, so that counts do not
        depend on timing."""
        peak = peak_rss_bytes()
        warnings = list(self.plan.warnings)
        if peak > self.opts.budget:
            warnings.append(
                f"peak RSS {peak / 1e9:.3f} GB exceeded --budget {self.opts.budget / 1e9:.3f} GB;"
                " raise --budget or report this run (the plan's estimates were too low)"
            )
        return RunStats(
            store=self.store.stats(),
            trunk=self.trunk.stats(),
            engram=self.engram.stats() if self.engram is not None else None,
            phases=self.engine.phases.totals(),
            working_set_experts=self.cfg.working_set_experts,
            peak_rss_bytes=peak,
            budget_bytes=self.opts.budget,
            planned_bytes=self.plan.planned_bytes,
            kernel_backend=kernels.backend_name(),
            kernel_warmup_seconds=self.kernel_warmup_seconds,
            numerics=numerics_label(self.engine.numerics),
            warnings=warnings,
            prefill_segment=self.plan.prefill_segment,
            prefill_lent_slots=self.most_lent,
            load_seconds=self.load_seconds,
            decode_threads=self.engine.governor.summary() if self.engine.governor is not None else {},
            unused=self.plan.needs.unused or "",
        )

    def close(self) -> None:
        self.experts.release()
        self.trunk.close()
        if self.engram is not None:
            self.engram.close()  # before the store: its reads run on the store's threads
        self.store.close()
        if self.trunk_file is not None:
            self.trunk_file.close()
        trim_heap()  # the heap's recycled activations (`recycle_heap`) are no longer this run's

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_counters(store: ExpertStore, trunk: StreamedTrunk, engram: DiskEngramRows | None) -> Counters:
    """`Counters` of a run's providers (the engine's meter): none of them waits for a read."""
    s = store.stats()
    g = engram.stats() if engram is not None else None
    return Counters(
        expert_requests=s.requests,
        expert_hits=s.hits,
        expert_bytes_read=s.bytes_read,
        expert_read_seconds=s.read_seconds,
        expert_wait_seconds=s.wait_seconds,
        trunk_bytes_read=trunk.bytes_read,
        trunk_wait_seconds=trunk.wait_seconds,
        engram_bytes_read=g.bytes_read if g is not None else 0,
        engram_wait_seconds=g.wait_seconds if g is not None else 0.0,
    )


def _memory_parts(cat: Catalog, opts: RunOptions, packed: bool, plan: Plan) -> dict[str, object]:
    """What `--speculate auto`'s remembered figures hold for (`engine.spec_memory`): a drafter's
    cost per step and its acceptance depend on the checkpoint, the numerics, what streams (the
    plan's resident layers and its expert cache, in steps of 5 % of the experts: the budget
    itself defaults to a share of the memory available at the start, which moves from one run to
    the next), the kernel threads and the CPU (the target the kernels compile for, and the cores)."""
    family = cat.config.family
    total = plan.needs.total_experts
    cached = "all" if plan.expert_slots >= total else f"{plan.expert_slots * 20 // max(total, 1) * 5}%"
    return {
        "checkpoint": cat.fingerprint,
        "numerics": opts.numerics or NUMERICS_DEFAULTS[family],
        "resident": f"{plan.pinned_layers} of {cat.config.n_layers} layers, experts cached: {cached}",
        "threads": opts.threads if opts.threads is not None else kernels.get_threads(),
        "trunk": "packed" if packed else "shards",
        "gpu": opts.gpu is not None and opts.gpu.enabled,
        "cpu": " ".join((*kernel_cpu.target(), str(os.cpu_count()))),  # what the kernels compile for
    }
