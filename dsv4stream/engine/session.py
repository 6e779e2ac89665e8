"""The public API of the forward pass: a read-only `Engine` and one `Session` per sequence.

Owns: opening a checkpoint (catalog, config, validation, providers), the per-sequence state
(per layer: the window ring, compressed rows, open compressor windows and overlap halves of
the main and indexer compressors; no full-length KV), and running chunks of tokens through
all layers. Math lives in `dsv4stream.model`; weights come through the `Trunk` and
`Experts` providers, so streaming implementations can replace the in-memory defaults.

Prefill is layer-major, in segments of `segment` tokens: the whole segment goes through
layer i before layer i+1 starts. Inside a layer, attention runs over the segment in
sub-chunks of `chunk_size` tokens (causal, the state updated in order, temporaries bounded
by the sub-chunk), then one MoE pass over the whole segment fetches each routed expert
once and applies it to all its tokens. So a prompt reads each (layer, expert) it touches
once per segment and a streamed trunk layer once per segment, not once per chunk. `step`
is a segment of one. Any segment or chunk size gives the same logits up to float rounding
(each token sums its experts in a fixed order). Activations are float32. The last layer of a
pass computes only the rows whose outputs are used (`_rows_used`): the last one when only the
last position's logits are wanted, none in a segment before the last; every row still updates
every layer's state.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from .. import kernels
from ..checkpoint.catalog import Catalog, TensorSource
from ..checkpoint.config import V41, ModelConfig
from ..checkpoint.tensors import layer_prefix
from ..errors import NumericsError, UsageError
from ..model.moe import GroupedSource
from ..model.scan import nonfinite_fields
from ..model.trace import Trace
from ..text.sampler import greedy
from ..weights.providers import CatalogExperts, CatalogTrunk, EngramRows, ExpertKey, Experts, Trunk, grouped_source
from . import numerics as run_numerics
from .family import build_stack
from .phases import Meter, PhaseLog, PrefillStep, StepClock, Turn, no_reads
from .stack_v41 import EngramIds, SpanRows, V41Options
from .state import SessionState, capture, thaw
from .steps import Pass, PassContext, Stack
from .threads import ThreadGovernor

# on_route(layer, positions (T,), experts (T, k)): called before a layer's experts are fetched
RouteHook = Callable[[int, np.ndarray, np.ndarray], None]

DEFAULT_SEGMENT = 4096  # prefill segment of a session made without one (the planner picks a run's)
# Why a generation ended: EOS chosen, max_new_tokens reached, feeding the token would pass
# max_pos (--ctx), or the caller stopped it (Ctrl-C: the prefill or the token stream was cut short).
STOP_REASONS = ("eos", "gen_limit", "context_full", "interrupted")


# on_layer(step): after each layer of each prefill segment; it may raise to stop the prefill
LayerHook = Callable[[PrefillStep], None]


class DevicePlacement(Protocol):
    """What `Engine.open` needs of a GPU context (`dsv4stream.gpu.GpuContext`): whether it is on,
    placing the trunk's matrices, and a source that serves the placed copies."""

    enabled: bool

    def place(self, cat: Catalog) -> object: ...

    def source(self, cat: Catalog) -> TensorSource: ...


class Engine:
    """A loaded model: config, weight providers, the family's stack. Shared by sessions; its weights
    never change. `phases` collects every session's generate calls as each session timed them;
    `meter` reads the providers' counters (streaming providers: read waits and bytes) for them.

    DeepSeek-V4.1 also takes its Engram rows (`engram_rows`: default, read from the catalog on
    demand), the Engram hash (`engram_ids`: default, from the checkpoint's tokenizer.json) and
    `v41` (numerics and index keys, `V41Options`).

    `numerics` ("exact", "official", "fast"; `engine.numerics`) is set for the whole process
    here, when the engine is built (None: V4.1's `v41.numerics`, else the family's default, V4
    exact and V4.1 official); `self.numerics` is the mode the engine runs."""

    def __init__(
        self,
        cfg: ModelConfig,
        trunk: Trunk,
        experts: Experts,
        catalog: Catalog | None = None,
        *,
        engram_rows: EngramRows | None = None,
        engram_ids: EngramIds | None = None,
        v41: V41Options | None = None,
        numerics: str | None = None,
        meter: Meter = no_reads,
    ) -> None:
        mode = run_numerics.canonical(
            numerics or (v41.numerics if v41 is not None and v41.numerics else run_numerics.DEFAULTS[cfg.family])
        )
        if cfg.family == V41:
            v41 = replace(v41 or V41Options(), numerics=mode)
        run_numerics.apply(cfg.family, mode)
        if mode == "fast" and kernels.int8_trunk() and hasattr(trunk, "use_int8_trunk"):
            trunk.use_int8_trunk()  # no BF16 dot product here: the resident FP8 trunk as int8 (`trunkq8`)
        self.numerics = mode
        self.cfg = cfg
        self.trunk = trunk
        self.experts = experts
        self.catalog = catalog
        self.meter = meter
        self.phases = PhaseLog()
        # picks decode steps' kernel threads when the user did not fix them (`engine/threads.py`)
        self.governor: ThreadGovernor | None = None
        self.stack: Stack = build_stack(
            cfg, trunk, experts, catalog, engram_rows=engram_rows, engram_ids=engram_ids, v41=v41
        )

    @classmethod
    def open(
        cls,
        checkpoint_dir: str | os.PathLike,
        *,
        experts: Experts | None = None,
        trunk: Trunk | None = None,
        threads: int | None = None,
        validate: bool = True,
        gpu: DevicePlacement | None = None,
        v41: V41Options | None = None,
        numerics: str | None = None,
    ) -> Engine:
        """Open a checkpoint directory in the release format (read-only).

        experts / trunk replace the in-memory defaults (e.g. a streaming expert store);
        threads sets the kernel thread count; gpu places trunk matrices in VRAM for the
        default in-memory trunk; v41: a V4.1 checkpoint's numerics and index keys; numerics:
        the run's ("exact", "official", "fast"; None: see the class).
        """
        cat = Catalog.open(checkpoint_dir)
        if validate:
            cat.validate()
        if threads is not None:
            kernels.set_threads(threads)
        if trunk is None:
            on_gpu = gpu is not None and gpu.enabled
            if on_gpu:
                gpu.place(cat)
            trunk = CatalogTrunk(gpu.source(cat) if on_gpu else cat)
        return cls(cat.config, trunk, experts or CatalogExperts(cat), cat, v41=v41, numerics=numerics)

    def session(
        self,
        *,
        chunk_size: int = 64,
        segment: int | None = None,
        on_route: RouteHook | None = None,
        record_requests: bool = False,
        trace: Trace | None = None,
        before_pass: Callable[[int], None] | None = None,
    ) -> Session:
        return Session(
            self,
            chunk_size=chunk_size,
            segment=segment,
            on_route=on_route,
            record_requests=record_requests,
            trace=trace,
            before_pass=before_pass,
        )


def segment_cuts(n: int, segment: int, boundaries: Collection[int] = ()) -> list[int]:
    """Where a prefill of n tokens ends its segments (the last cut is n): every `segment` tokens
    and at each boundary 0 < b < n (`Session.prefill`; a joined prefill, `engine.batch`, cuts alike)."""
    return sorted({*range(segment, n, segment), *(int(b) for b in boundaries if 0 < b < n), n})


def _stop_reason(eos: bool, context_full: bool, gen_limit: bool) -> str | None:
    """Why generation ends after this token (None: it goes on); EOS first, then the context
    (feeding the token would pass max_pos), then max_new_tokens."""
    if eos:
        return "eos"
    if context_full:
        return "context_full"
    return "gen_limit" if gen_limit else None


_NAN_ADVICE = (
    "a weight or scale (an E8M0 scale byte 0xFF is NaN) of the checkpoint holds NaN/inf — re-download the"
    " shard holding it, or re-pack the trunk if it came from a packed trunk (`dsv4 inspect` checks the pack)"
)


def layer_numerics_error(cfg: ModelConfig, i: int, w, e: NumericsError) -> NumericsError:
    """A NumericsError raised in layer i (weights w), naming the layer's weights that hold NaN/inf."""
    bad = nonfinite_fields(w)
    where = f" (non-finite values in {', '.join(layer_prefix(cfg, i) + b for b in bad[:4])})" if bad else ""
    return NumericsError(f"layer {i}: {e}{where}; {_NAN_ADVICE}")


class Session:
    """One sequence: owns its state and position; tokens go in, logits come out.

    `segment`: prefill segment (tokens through each layer together; default DEFAULT_SEGMENT);
    `chunk_size`: attention sub-chunk inside a segment. An exception that escapes a forward
    pass mid-segment (Ctrl-C from `on_layer`) leaves the layers' state out of step: the
    session is then `torn` and refuses more tokens; `pos` counts the tokens fully fed.
    `before_pass(tokens)` runs before each forward pass (a prefill segment, or a step's one
    token), before any of its reads start: a budgeted run moves bytes between the expert
    cache and the pass's activations there.

    Hook for a speculative drafter: DeepSeek-V4.1's DSpark stages read the streams entering main
    layers `cfg.dspark.target_layer_ids`, the V4.1 stack's `trace("input", layer, x)` calls,
    (T, hc, D) per layer and pass, in position order (`engine.dspark_v41`,
    `engine.speculate_v41`). A drafter keeps its own window state beside `state` and never
    changes the main model's state, so verification is an ordinary `prefill` of the drafted
    tokens (and a rejection a `restore` of the snapshot taken before it).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        chunk_size: int = 64,
        segment: int | None = None,
        on_route: RouteHook | None = None,
        record_requests: bool = False,
        trace: Trace | None = None,
        before_pass: Callable[[int], None] | None = None,
    ) -> None:
        segment = DEFAULT_SEGMENT if segment is None else segment
        if chunk_size < 1 or segment < 1:
            raise UsageError(f"chunk and segment sizes must be at least 1, found {chunk_size} and {segment}")
        self.engine = engine
        self.cfg = engine.cfg
        self.chunk_size = chunk_size
        self.segment = segment
        self.torn = False
        self.on_route = on_route
        self.trace = trace
        self.before_pass = before_pass
        # (layer, expert) in the order the experts were requested, when record_requests is on
        self.requests: list[ExpertKey] | None = [] if record_requests else None
        self.pos = 0
        self.stop_reason = ""  # why the last generate() ended (STOP_REASONS)
        self.turn: Turn | None = None  # the last generate() call's phases (also in engine.phases)
        self._last_step: PrefillStep | None = None  # the last layer a prefill finished
        self.stack = engine.stack
        self._ahead: _ReadAhead | None = None  # reads started for the next pass (`read_ahead`)
        self.state: list = self.stack.new_state()

    # ---- public ----------------------------------------------------------------
    def prefill(
        self,
        token_ids: Sequence[int] | np.ndarray,
        *,
        last_only: bool = False,
        progress: Callable[[int], None] | None = None,
        on_layer: LayerHook | None = None,
        boundaries: Collection[int] = (),
        spans: SpanRows | None = None,
    ) -> np.ndarray:
        """Feed tokens in segments: logits (T, vocab) float32, or (vocab,) for the last with last_only.

        `progress(tokens_done)` runs after each segment, between forward passes: the place
        where a caller may stop cleanly (the state then holds the segments fed so far), or take
        a snapshot. `boundaries`: token counts (0 < b < len) where a segment must also end, so
        that `progress` sees the state there (a server keeps the state one token short of the
        prompt). `on_layer(PrefillStep)` runs after each layer of each segment; raising there
        stops within one layer, and leaves the session torn.

        `spans` (V4.1): the image spans of these tokens (`engine.images`). As DeepSeek's
        reference requires, they go in the first forward pass of a fresh sequence: the first
        segment is stretched to hold the last span."""
        ids = self._check_ids(token_ids)
        if ids.size == 0:
            raise UsageError("prefill needs at least one token")
        out = []
        n, seg = ids.size, self.segment
        cuts = segment_cuts(n, seg, boundaries)
        if spans is not None:
            if self.stack.family != V41 or self.pos != 0 or spans.types.size != n:
                raise UsageError("images go only at the start of a fresh DeepSeek-V4.1 sequence (its first prefill)")
            last = int(np.flatnonzero(spans.mask)[-1]) + 1 if spans.mask.any() else 0
            cuts = [c for c in cuts if c >= last]
        segments = len(cuts)

        def layer_done(step: PrefillStep) -> None:
            self._last_step = step
            if on_layer is not None:
                on_layer(step)

        for j, (a, b) in enumerate(zip([0, *cuts[:-1]], cuts, strict=True)):
            part = ids[a:b]
            want_logits = not last_only or b >= n
            hook = lambda i, j=j, a=a, t=part.size: layer_done(
                PrefillStep(i + 1, self.cfg.n_layers, j + 1, segments, a, t, n)
            )
            part_spans = None if spans is None or a > 0 else spans.part(a, b)
            out.append(self._forward(part, logits=want_logits, last_only=last_only, after_layer=hook, spans=part_spans))
            if progress is not None:
                progress(a + part.size)
        return out[-1][-1] if last_only else np.concatenate(out)

    def step(self, token_id: int) -> np.ndarray:
        """Feed one token: logits (vocab,) float32."""
        return self._forward(self._check_ids([token_id]), logits=True, last_only=False)[0]

    def step_with_rows(self, token_id: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`step`, with `rows` (n, D) (a drafter's, normed for the head) through the same head
        call: (logits (vocab,), their logits (n, vocab)). The head's weights are read once for
        both, and the token's logits are the bits `step` gives (every product's row is its own
        whatever the rows beside it). Only where `folds_rows`."""
        out = self._forward(self._check_ids([token_id]), logits=True, last_only=False, extra=rows)
        return out[0], out[1:]

    def folds_rows(self) -> bool:
        """Whether `step_with_rows` may run: the head is multiplied on the CPU (a GPU's product
        is not promised the same bits for a row whatever the rows beside it)."""
        return not getattr(self.stack.head_weights().head, "on_device", False)

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        pick: Callable[[np.ndarray], int] | None = None,
        *,
        stop_ids: Collection[int] = (),
        max_pos: int | None = None,
        progress: Callable[[int], None] | None = None,
        on_layer: LayerHook | None = None,
        boundaries: Collection[int] = (),
        logits: np.ndarray | None = None,
        spans: SpanRows | None = None,
        batched: bool = False,
        prompt_read: float | None = None,
    ) -> Generator[int, tuple | None, None]:
        """Prefill `prompt_ids`, then yield up to `max_new_tokens` tokens chosen by `pick(logits)`
        (default: greedy, ties to the lower id); stop after a token in `stop_ids`, or when
        feeding the token would take the session past `max_pos` positions.

        Every yielded token but the last has been fed; the last one has not (no forward pass
        is spent on logits nobody reads): a later turn starts by feeding it. `stop_reason` then
        says why it ended (STOP_REASONS; "interrupted" when the caller closed the generator or
        a forward pass raised). A token's reads that depend on it alone start as soon as it is
        picked, while the caller handles it (`read_ahead`). `progress`, `on_layer` and
        `boundaries` go to `prefill`, as do `spans` (V4.1's image spans of the prompt).

        `logits`: continue without a prefill from the logits of this session's last position
        (kept from the session a restored state was taken from; `prompt_ids` then empty): one
        prompt, several replies (a server's `n` choices) each read it once.

        The call's phases go to `turn` (and `engine.phases`) as they happen: the prefill (to the
        first logits; where it stopped if it raised), the time to the first token, each decode
        step's forward pass split by phase, each later pick (the sampler), the reads from the
        end of the prefill on, why it ended.

        `batched`: the caller feeds each token with others' in one pass (`engine.batch.step_many`,
        the server's continuous batching) and sends this generator that step's result,
        `(logits, wall seconds, seconds by phase)`, instead of calling `next`; no thread count
        is tried then. A plain `next` still steps the token here.

        `prompt_read`: the caller fed `prompt_ids` itself, from that perf_counter time on, in passes
        shared with other sequences (the server's joined prefill, `engine.batch.forward_many`), and
        `logits` are its last position's: the turn records them as its prefill."""
        pick = pick or greedy
        if logits is not None and len(prompt_ids) and prompt_read is None:
            raise UsageError("generate: give the prompt ids or the logits to continue from, not both")
        t0 = time.perf_counter() if prompt_read is None else prompt_read
        turn = self.turn = Turn()
        self.engine.phases.turns.append(turn)
        meter, clock = self.engine.meter, StepClock(self.engine.meter)
        gov, threads = (None if batched else self.engine.governor), 0
        self.stop_reason = "interrupted"
        mark = meter() if logits is not None else None
        try:
            if logits is None:
                logits = self._timed_prefill(turn, t0, prompt_ids, progress, on_layer, boundaries, spans)
                mark = meter()  # the decode's reads start here
            elif prompt_read is not None:
                turn.prefill_seconds, turn.prompt_tokens = time.perf_counter() - t0, len(prompt_ids)
            if max_new_tokens <= 0:
                self.stop_reason = "gen_limit"
                return
            fed: tuple | None = None
            for n in range(max_new_tokens):
                if fed is not None:  # the caller's batched pass fed the previous token
                    logits, wall, spent = fed
                    turn.add_step(wall, spent)
                elif n:
                    wall, spent = clock.end()  # the step that fed the previous token
                    turn.add_step(wall, spent)
                    if gov is not None:  # its compute: threads do not change the waits on reads
                        gov.record(threads, wall - spent["expert_reads"] - spent["trunk_reads"])
                t_pick = time.perf_counter()
                tok = pick(logits)
                if n:
                    turn.profile["sampler"] += time.perf_counter() - t_pick
                elif turn.prompt_tokens is not None:
                    turn.first_token_seconds = time.perf_counter() - t0
                turn.tokens.append(tok)
                stop = _stop_reason(
                    tok in stop_ids, max_pos is not None and self.pos >= max_pos, n + 1 == max_new_tokens
                )
                if stop is not None:
                    self.stop_reason = stop
                    yield tok
                    return
                self.read_ahead([tok])  # batched too: the reads overlap the caller's handling of the token
                fed = yield tok
                if fed is not None:
                    continue
                if gov is not None:
                    want = gov.next_threads()  # may start a try: ask once per step
                    if want != threads:
                        threads = want
                        kernels.set_threads(threads)
                clock.begin()
                logits = self.step(tok)
        finally:
            if gov is not None and threads not in (0, gov.most):
                kernels.set_threads(gov.most)  # prefills keep every thread
            turn.close(self.stop_reason, t0, meter, mark)

    def snapshot(self) -> SessionState:
        """An immutable copy of this session's state (position, rings, compressed rows)."""
        return capture(self.pos, self.state)

    def restore(self, snap: SessionState) -> None:
        """Continue from `snap`: the next logits equal those of the session it was taken from."""
        if len(snap.layers) != len(self.state):
            raise UsageError(f"a state of {len(snap.layers)} layers cannot restore a {len(self.state)}-layer session")
        self.state, self.pos = thaw(snap), snap.pos
        self._ahead = None

    def read_ahead(self, token_ids: Sequence[int] | np.ndarray, pass_tokens: int | None = None) -> None:
        """Start the reads that the next forward pass's token ids alone decide (V4's hash-layer
        experts; V4.1's Engram rows) while the caller still holds them: `generate` calls it as
        soon as a token is picked. The next `prefill` / `step` of exactly these ids, at this
        position, uses what was started instead of asking again. `pass_tokens`: the tokens of
        that pass when it carries other sequences' too (`engine.batch.step_many`; default these ids')."""
        ids = self._check_ids(token_ids)
        if self.before_pass is not None:
            self.before_pass(pass_tokens or ids.size)  # the pass's memory first: these reads go into its slots
        self._ahead = _ReadAhead(self.pos, ids, self.stack.read_ahead(ids, self.state))

    # ---- internals -------------------------------------------------------------
    def _timed_prefill(
        self, turn: Turn, t0: float, prompt_ids, progress, on_layer, boundaries, spans=None
    ) -> np.ndarray:
        """`generate`'s prefill: its seconds since `t0` and the tokens it fed go to `turn`, and
        where it stopped when it raised."""
        pos0, self._last_step = self.pos, None
        try:
            return self.prefill(
                prompt_ids, last_only=True, progress=progress, on_layer=on_layer, boundaries=boundaries, spans=spans
            )
        except BaseException:
            if self._last_step is not None:
                where = self._last_step.where()
                turn.prefill_stopped = f"{self.pos - pos0} of {len(prompt_ids)} tokens fed; stopped after {where}"
            raise
        finally:
            turn.prefill_seconds, turn.prompt_tokens = time.perf_counter() - t0, self.pos - pos0

    def _check_ids(self, token_ids) -> np.ndarray:
        if self.torn:
            raise UsageError("this session was stopped in the middle of a forward pass; start a new session")
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        v = self.cfg.vocab_size
        if ids.size and (ids.min() < 0 or ids.max() >= v):
            bad = int(ids[(ids < 0) | (ids >= v)][0])
            raise UsageError(f"token id {bad} is outside the vocabulary 0..{v - 1}")
        return ids

    def _forward(
        self,
        ids: np.ndarray,
        *,
        logits: bool,
        last_only: bool,
        after_layer: Callable[[int], None] | None = None,
        spans: SpanRows | None = None,
        extra: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """One segment through every layer: begin (reads ahead, embedding), each layer (attention
        in sub-chunks, then one MoE pass), then the logits (with those of `extra`'s rows after
        them: `step_with_rows`). A failure on the way leaves the session torn: its layers'
        states are out of step with one another."""
        # the kernels' numerics is the process's: put this engine's back if another engine
        # built since changed it (one string compare a pass)
        run_numerics.ensure(self.engine.cfg.family, self.engine.numerics)
        if self.before_pass is not None:
            self.before_pass(ids.size)
        p = self._begin(ids, spans)  # nothing of the state has changed yet: a failure here leaves it whole
        keep = self._rows_used(ids.size, logits, last_only)
        last = self.cfg.n_layers - 1
        try:
            for i in range(self.cfg.n_layers):
                self._layer(p, i, keep if i == last else None)
                if after_layer is not None:
                    after_layer(i)
        except BaseException:
            self.torn = True
            raise
        self.pos += ids.size
        return self._logits(p, last_only, extra) if logits else None

    def _begin(self, ids: np.ndarray, spans: SpanRows | None = None) -> Pass:
        """The pass's positions and streams; the reads ahead started by `read_ahead` for exactly
        these ids at this position are used, else started now (with image spans: always now)."""
        ahead, self._ahead = self._ahead, None
        positions = np.arange(self.pos, self.pos + ids.size, dtype=np.int64)
        if spans is not None:
            got = lambda: self.stack.read_ahead(ids, self.state, spans)
            return self.stack.begin(ids, positions, self.state, got, spans)
        if ahead is not None and ahead.pos == self.pos and np.array_equal(ahead.ids, ids):
            got = lambda: ahead.payload
        else:
            got = lambda: self.stack.read_ahead(ids, self.state)
        return self.stack.begin(ids, positions, self.state, got)

    def _rows_used(self, t: int, logits: bool, last_only: bool) -> int | None:
        """How many of a pass's last rows the last layer must give outputs for (None: all). The
        last layer's outputs feed the head alone (every layer's state comes from its inputs),
        so a pass that wants the last position's logits needs one row and a pass that wants
        none (a prefill segment before the last) no row: the last layer's query path, mixing
        and MoE skip the others (`Stack.layer`'s keep). Not with a trace that reads layers'
        outputs ("attn", "ffn", "hidden": any trace but one whose `reads_outputs` is False, such
        as a drafter's taps, which are the streams entering layers, whole before the cut)."""
        if self.trace is not None and getattr(self.trace, "reads_outputs", True):
            return None
        if not logits:
            return 0
        return 1 if last_only and t > 1 else None

    def _layer(self, p: Pass, i: int, keep: int | None = None) -> None:
        """Layer i on the pass (keep: `Stack.layer`'s); a NumericsError names the layer's weights
        that hold NaN/inf."""
        w = self.engine.trunk.layer(i)
        try:
            self.stack.layer(self.pass_context(), p, i, w, self.state, keep)
        except NumericsError as e:
            raise layer_numerics_error(self.cfg, i, w, e) from None

    def pass_context(self) -> PassContext:
        """What this session lends its stack for a pass (sub-chunk, trace, expert source, routing hook)."""
        return PassContext(self.chunk_size, self.trace, self._experts_of, self._routed)

    def _logits(self, p: Pass, last_only: bool, extra: np.ndarray | None = None) -> np.ndarray:
        """The head on the pass's streams (then on `extra`'s rows, whose logits are not checked:
        a drafter's); NaN/inf logits are an error naming what holds them."""
        out = self.stack.logits(p, last_only, extra)
        own = out if extra is None else out[: out.shape[0] - extra.shape[0]]
        if not np.isfinite(own).all():  # (T, vocab): a few µs per token next to the head's matvec
            bad = nonfinite_fields(self.stack.head_weights())
            if bad:
                raise NumericsError(
                    f"the logits are NaN or infinite: the head's {', '.join(bad[:4])} hold NaN/inf; {_NAN_ADVICE}"
                )
            raise NumericsError(
                f"the logits (head.weight, after layer {self.cfg.n_layers - 1}) are NaN or infinite; {_NAN_ADVICE}"
            )
        return out

    def _routed(self, layer: int, positions: np.ndarray, prefetch: bool = True) -> Callable[[np.ndarray], None]:
        """The MoE's hook once a layer has routed: `on_route`, then the expert reads (skipped where
        `read_ahead` asked for them already: V4's hash layers)."""

        def hook(experts: np.ndarray) -> None:
            if self.on_route is not None:
                self.on_route(layer, positions, experts)
            if prefetch:
                self.engine.experts.prefetch([(layer, int(e)) for e in np.unique(experts)])

        return hook

    def _experts_of(self, layer: int) -> GroupedSource:
        """The MoE's expert source for one layer: the provider's experts in groups pinned
        together (`weights.providers.expert_groups`), the requests recorded first."""

        def record(ids: np.ndarray) -> None:
            if self.requests is not None:
                self.requests.extend((layer, int(e)) for e in ids)

        return grouped_source(self.engine.experts, layer, record)


@dataclass(frozen=True)
class _ReadAhead:
    """Reads `Session.read_ahead` started for the pass that feeds `ids` at position `pos`."""

    pos: int
    ids: np.ndarray
    payload: object
