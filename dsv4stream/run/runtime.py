"""A budgeted run: open a checkpoint under `--budget`, generate tokens, collect statistics.

Owns: planning what `memory.memory_needs` measured (`planner.plan`), compiling the kernels
outside the budget, wiring the streaming providers (`streaming`) into an `Engine`,
`Runtime.generate` (the session's generation loop, timed and stopped at --ctx), and filling
the run's figures (`runinfo.RunStats`). The CLI (`cli/run.py`), the demo and the benches
go through `Runtime`; the math stays in `engine` / `model`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Self

import numpy as np

from .. import kernels
from ..checkpoint.catalog import Catalog
from ..engine.session import Engine, LayerHook, PrefillStep, Session
from ..errors import Dsv4Error, UsageError
from ..store import ExpertStore
from ..store.rowcache import RowStats
from ..streaming.engram import DiskEngramRows
from ..streaming.expert_layout import expert_label
from ..streaming.experts import StreamedExperts
from ..streaming.layout import trunk_layout
from ..streaming.reader import GroupReader
from ..streaming.ring import StreamedTrunk
from ..text.sampler import greedy
from ..trunkpack.packdir import default_out_dir, pack_hint
from ..trunkpack.reader import TrunkFile, open_trunk_file
from . import planner, ticker
from .memory import main_expert_layouts, memory_needs, peak_rss_bytes
from .planner import Plan
from .profile import DecodeProfile
from .runinfo import RunOptions, RunStats

Pick = Callable[[np.ndarray], int]
Warn = Callable[[str], None]

COMPILE_CHILD = (
    "import os, sys, time; from dsv4stream import kernels; kernels.set_backend('fast'); "
    "t = kernels.warmup(); print(os.getpid(), t)"
)


def compile_kernels_apart(say: Warn | None = None) -> tuple[int, float] | None:
    """On a cold numba cache, compile the kernels in a child process and wait for it.

    The compiler (LLVM) takes hundreds of MB that the plan does not count; in a child they
    never enter this process's peak RSS, and this process then loads the kernels from the
    cache the child wrote. Returns (child pid, its compile seconds), or None when the cache
    was warm (or the kernels are not numba's)."""
    if kernels.backend_name() != "fast" or kernels.compiled_cache_exists():
        return None
    if say is not None:
        say(
            "compiling the numba kernels in a separate process (once per installation, about 1 minute on 2"
            " cores; cached after), so that the compiler's memory stays outside --budget"
        )
    import subprocess
    import sys

    import dsv4stream

    env = dict(os.environ)
    src = str(Path(dsv4stream.__file__).resolve().parents[1])  # this checkout, installed or not
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    with ticker.elapsed("compiling the numba kernels"):
        r = subprocess.run([sys.executable, "-c", COMPILE_CHILD], env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no message"])[-1]
        raise Dsv4Error(
            f"compiling the numba kernels failed in a child process ({why}); reinstall numba or set DSV4_DEBUG=1"
        )
    pid, seconds = r.stdout.split()[-2:]
    return int(pid), float(seconds)


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
        self._generated: list[int] = []
        self._prompt_tokens = 0
        self._prefill_seconds = 0.0
        self._decode_seconds = 0.0
        self._decode_tokens = 0
        self.kernel_warmup_seconds = 0.0
        self._turn_prompt_tokens: list[int] = []
        self._first_token_seconds: list[float] = []
        self._prefill_stopped = ""
        self._profile = DecodeProfile()
        self._stop_reasons: list[str] = []
        self._in_think: list[bool] = []
        self.load_seconds = 0.0
        self._decode_bytes = [0, 0]  # read from disk during decode steps: experts, Engram

    @classmethod
    def open(cls, checkpoint: str | os.PathLike, opts: RunOptions, warn: Warn | None = None) -> Runtime:
        """Plan `opts.budget` on this checkpoint (BudgetError if it cannot work) and load what
        the plan keeps resident. `warn` receives one-time notices (O_DIRECT refused); `opts.gpu`
        moves trunk matrices to VRAM, out of the budget."""
        if opts.io not in ("direct", "buffered"):
            raise UsageError(f"--io {opts.io!r}: use direct or buffered")
        if opts.chunk < 1 or opts.ctx < 1:
            raise UsageError(f"chunk and ctx must be at least 1, found {opts.chunk} and {opts.ctx}")
        if opts.prefill_segment is not None and opts.prefill_segment < 1:
            raise UsageError(f"--prefill-segment {opts.prefill_segment}: give at least 1 token")
        t_open = time.perf_counter()
        gpu = opts.gpu
        cat = Catalog.open(checkpoint)
        cat.validate()
        cfg = cat.config
        once = _Once(warn)
        tf = open_trunk_file(cat, opts.trunk, verify=opts.verify)
        placed = gpu.place(cat) if gpu is not None and gpu.enabled else None
        layout = trunk_layout(cat, tf, exclude=placed.tensor_names if placed is not None else frozenset())
        layouts, order = main_expert_layouts(cat)
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
                f"no packed trunk in {default_out_dir(cat.root)}: reading the trunk from the shards; {pack_hint(cat.root)}"
            )
        if opts.threads is not None:
            kernels.set_threads(opts.threads)
        compile_kernels_apart(once)
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
        engram: DiskEngramRows | None = None
        trunk: StreamedTrunk | None = None
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
            trunk = StreamedTrunk(cat, layout, plan.pinned_layers, reader, plan.ring_slot_bytes or None, wrap)
            engine = Engine(cfg, trunk, StreamedExperts(store, cfg), cat, engram_rows=engram)
        except BaseException:
            if trunk is not None:
                trunk.close()
            if engram is not None:
                engram.close()
            store.close()
            raise
        rt = cls(cat, opts, plan, engine, store, trunk, tf, engram)
        rt.kernel_warmup_seconds = warmup_seconds
        rt.load_seconds = time.perf_counter() - t_open
        return rt

    # -- generation --------------------------------------------------------------------------

    def session(self, **kw) -> Session:
        """A session with this run's sub-chunk and planned prefill segment (kw: `Engine.session`'s hooks)."""
        return self.engine.session(chunk_size=self.opts.chunk, segment=self.plan.prefill_segment, **kw)

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
    ) -> Iterator[int]:
        """`session.generate` (the one generation loop) within this run: it also stops when
        the session holds `opts.ctx` positions (the context the plan covers is full), and its
        times go to `stats()`.

        As there, every yielded token but the last has been fed to the session; a later turn
        starts with the last one. `progress(done, total)` runs after each prefill segment,
        `on_layer(PrefillStep)` after each layer of each segment (`boundaries`: where a segment
        must also end, as `Session.prefill`); an exception either raises
        stops the prefill (within one layer from `on_layer`), and the tokens fully fed still
        count, with where it stopped (`prefill_stopped`). Timed: the prefill (to the first
        logits), the time to the first token, each decode step (the decode profile's window)
        and the sampler; why it ended goes to `stop_reasons` (`engine.STOP_REASONS`).

        With `logits` (a reply continued from a restored state's logits, no prompt: the
        server's `n` > 1 choices) nothing is prefilled: no turn, no prefill time and no first
        token time are counted; its decode steps and picks are counted as any other's."""
        pick = pick or greedy
        n_prompt = len(prompt_ids)
        last: list[PrefillStep] = []

        def layer_done(step: PrefillStep) -> None:
            last[:] = [step]
            if on_layer is not None:
                on_layer(step)

        t0 = time.perf_counter()
        pos0 = session.pos
        picks = 0
        continued = logits is not None
        prefilled = continued  # there is no prefill to count
        t_step = 0.0

        decode_mark = (0, 0)

        def end_prefill() -> None:
            nonlocal prefilled, decode_mark
            if not prefilled:
                prefilled = True
                decode_mark = self._read_bytes()
                fed = session.pos - pos0
                self._prefill_seconds += time.perf_counter() - t0
                self._prompt_tokens += fed
                self._turn_prompt_tokens.append(fed)

        def timed_pick(logits: np.ndarray) -> int:
            # the loop picks right after each forward pass: the first pick ends the prefill,
            # each later one a decode step
            nonlocal picks
            t_pick = time.perf_counter()
            if picks == 0:
                end_prefill()  # nothing when continued: the first pick reads logits given
            else:
                self._decode_seconds += t_pick - t_step
                self._profile.end(self.store, self.trunk)
                self._decode_tokens += 1
            tok = pick(logits)
            if picks == 0:
                if not continued:
                    self._first_token_seconds.append(time.perf_counter() - t0)
            else:
                self._profile.seconds["sampler"] += time.perf_counter() - t_pick
            picks += 1
            return tok

        report = (lambda done: progress(done, n_prompt)) if progress is not None else None
        tokens = session.generate(
            prompt_ids, max_new_tokens, timed_pick, stop_ids=stop_ids, max_pos=self.opts.ctx,
            progress=report, on_layer=layer_done, boundaries=boundaries, logits=logits,
        )  # fmt: skip
        self._in_think.append(False)
        try:
            while True:
                try:
                    tok = next(tokens)
                except StopIteration:
                    break
                except BaseException:
                    if not prefilled and last:
                        fed = session.pos - pos0
                        self._prefill_stopped = f"{fed} of {n_prompt} tokens fed; stopped after {last[0].where()}"
                    raise
                self._generated.append(tok)
                yield tok
                self._profile.begin(self.store, self.trunk)  # a step follows unless that was the last
                t_step = time.perf_counter()
        finally:
            tokens.close()
            end_prefill()
            for i, (now, mark) in enumerate(zip(self._read_bytes(), decode_mark, strict=True)):
                self._decode_bytes[i] += now - mark
            self._stop_reasons.append(session.stop_reason)

    @property
    def stop_reason(self) -> str:
        """Why the last generate call ended ("" before the first)."""
        return self._stop_reasons[-1] if self._stop_reasons else ""

    def mark_in_think(self) -> None:
        """The last generation ended inside the reasoning (before </think>): for the figures."""
        if self._in_think:
            self._in_think[-1] = True

    # -- figures and lifetime ----------------------------------------------------------------

    def _read_bytes(self) -> tuple[int, int]:
        """Bytes read from disk so far: routed experts, Engram rows."""
        return self.store.stats().bytes_read, self.engram.stats().bytes_read if self.engram is not None else 0

    def stats(self) -> RunStats:
        s = self.store.stats()
        r = self.trunk.stats()
        g = self.engram.stats() if self.engram is not None else None
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
            decode_profile=self._profile.per_token(self._decode_tokens),
            load_seconds=self.load_seconds,
            decode_tokens_per_second=self._decode_tokens / self._decode_seconds if self._decode_seconds else 0.0,
            stop_reasons=list(self._stop_reasons),
            stop_reason=self._stop_reasons[-1] if self._stop_reasons else "",
            stopped_in_think=list(self._in_think),
            unused=self.plan.needs.unused or "",
            **(_engram_figures(g) if g is not None else {}),
            decode_expert_bytes_per_token=self._decode_bytes[0] / self._decode_tokens if self._decode_tokens else 0.0,
            decode_engram_bytes_per_token=self._decode_bytes[1] / self._decode_tokens if self._decode_tokens else 0.0,
        )

    def close(self) -> None:
        self.experts.release()
        self.trunk.close()
        if self.engram is not None:
            self.engram.close()  # before the store: its reads run on the store's threads
        self.store.close()
        if self.trunk_file is not None:
            self.trunk_file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _engram_figures(g: RowStats) -> dict:
    return {
        "engram_cache_rows": g.capacity,
        "engram_requests": g.requests,
        "engram_hits": g.hits,
        "engram_misses": g.misses,
        "engram_hit_rate": g.hit_rate,
        "engram_rows_read": g.rows_read,
        "engram_bytes_read": g.bytes_read,
        "engram_wait_seconds": g.wait_seconds,
    }
