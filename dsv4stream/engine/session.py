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
(each token sums its experts in a fixed order). Activations are float32.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..checkpoint.catalog import Catalog
from ..checkpoint.config import ModelConfig
from ..checkpoint.spec import layer_prefix
from ..errors import NumericsError, UsageError
from ..kernels.blas import one_thread
from ..model.attention import ONE_THREAD_MACS, AttnState, attend_macs, new_attn_state
from ..model.block import Trace, attention_half, ffn_half, head_forward
from ..model.moe import ExpertWeights
from ..model.rope import Rope, rope_tables
from ..model.scan import nonfinite_fields
from ..text.sampler import greedy
from ..weights.providers import CatalogExperts, CatalogTrunk, ExpertKey, Experts, Trunk
from .state import SessionState, capture, thaw

# on_route(layer, positions (T,), experts (T, k)): called before a layer's experts are fetched
RouteHook = Callable[[int, np.ndarray, np.ndarray], None]

DEFAULT_SEGMENT = 4096  # prefill segment of a session made without one (the planner picks a run's)
# Why a generation ended: EOS chosen, max_new_tokens reached, feeding the token would pass
# max_pos (--ctx), or the caller stopped it (Ctrl-C: the prefill or the token stream was cut short).
STOP_REASONS = ("eos", "gen_limit", "context_full", "interrupted")


@dataclass(frozen=True)
class PrefillStep:
    """Where a prefill stands after one layer of one segment (counts from 1 where 'of')."""

    layer: int  # layers of this segment done, 1..layers
    layers: int
    segment: int  # 1..segments
    segments: int
    done: int  # tokens of the earlier segments (fully prefilled)
    segment_tokens: int
    total: int  # tokens of this prefill call

    @property
    def tokens(self) -> float:
        """Progress in tokens, counting a segment's layers pro rata."""
        return self.done + self.segment_tokens * self.layer / self.layers

    def where(self) -> str:
        return f"layer {self.layer}/{self.layers}, segment {self.segment}/{self.segments}"


# on_layer(step): after each layer of each prefill segment; it may raise to stop the prefill
LayerHook = Callable[[PrefillStep], None]


class Engine:
    """A loaded model: config, weight providers, rope tables. Shared by sessions, never mutated."""

    def __init__(self, cfg: ModelConfig, trunk: Trunk, experts: Experts, catalog: Catalog | None = None) -> None:
        self.cfg = cfg
        self.trunk = trunk
        self.experts = experts
        self.catalog = catalog
        self.rope_main, self.rope_comp = rope_tables(cfg)

    @classmethod
    def open(
        cls,
        checkpoint_dir: str | os.PathLike,
        *,
        experts: Experts | None = None,
        trunk: Trunk | None = None,
        threads: int | None = None,
        validate: bool = True,
        gpu=None,
    ) -> Engine:
        """Open a checkpoint directory in the release format (read-only).

        experts / trunk replace the in-memory defaults (e.g. a streaming expert store);
        threads sets the kernel thread count; gpu (a `dsv4stream.gpu.GpuContext`) places
        trunk matrices in VRAM for the default in-memory trunk.
        """
        cat = Catalog.open(checkpoint_dir)
        if validate:
            cat.validate()
        if threads is not None:
            kernels.set_threads(threads)
        if trunk is None:
            if gpu is not None and gpu.enabled:
                gpu.place(cat)
            trunk = CatalogTrunk(gpu.source(cat) if gpu is not None and gpu.enabled else cat)
        return cls(cat.config, trunk, experts or CatalogExperts(cat), cat)

    def rope_for(self, layer: int) -> Rope:
        return self.rope_comp if self.cfg.ratio(layer) else self.rope_main

    def session(
        self,
        *,
        chunk_size: int = 64,
        segment: int | None = None,
        on_route: RouteHook | None = None,
        record_requests: bool = False,
        trace: Trace | None = None,
    ) -> Session:
        return Session(
            self,
            chunk_size=chunk_size,
            segment=segment,
            on_route=on_route,
            record_requests=record_requests,
            trace=trace,
        )


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


class Session:
    """One sequence: owns its state and position; tokens go in, logits come out.

    `segment`: prefill segment (tokens through each layer together; default DEFAULT_SEGMENT);
    `chunk_size`: attention sub-chunk inside a segment. An exception that escapes a forward
    pass mid-segment (Ctrl-C from `on_layer`) leaves the layers' state out of step: the
    session is then `torn` and refuses more tokens; `pos` counts the tokens fully fed.

    Hook for a speculative drafter (not implemented): DeepSeek-V4-Flash-0731's DSpark stages
    read the outputs of main layers `cfg.dspark.target_layer_ids` (40-42), concatenated. Those
    are the `trace("hidden", layer, x)` calls, (T, hc, D) per layer after each chunk, in
    position order. A drafter keeps its own window state beside `state` (its stages are
    window-only blocks, mtp.* in the catalog) and never changes the main model's state, so
    verification is an ordinary `prefill` of the drafted tokens.
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
        # (layer, expert) in the order the experts were requested, when record_requests is on
        self.requests: list[ExpertKey] | None = [] if record_requests else None
        self.pos = 0
        self.stop_reason = ""  # why the last generate() ended (STOP_REASONS)
        self._hash_prefetched: np.ndarray | None = None  # ids whose hash-layer experts were asked for
        self.state: list[AttnState] = [new_attn_state(self.cfg, self.cfg.ratio(i)) for i in range(self.cfg.n_layers)]

    # ---- public ----------------------------------------------------------------
    def prefill(
        self,
        token_ids: Sequence[int] | np.ndarray,
        *,
        last_only: bool = False,
        progress: Callable[[int], None] | None = None,
        on_layer: LayerHook | None = None,
        boundaries: Collection[int] = (),
    ) -> np.ndarray:
        """Feed tokens in segments: logits (T, vocab) float32, or (vocab,) for the last with last_only.

        `progress(tokens_done)` runs after each segment, between forward passes: the place
        where a caller may stop cleanly (the state then holds the segments fed so far), or take
        a snapshot. `boundaries`: token counts (0 < b < len) where a segment must also end, so
        that `progress` sees the state there (a server keeps the state one token short of the
        prompt). `on_layer(PrefillStep)` runs after each layer of each segment; raising there
        stops within one layer, and leaves the session torn."""
        ids = self._check_ids(token_ids)
        if ids.size == 0:
            raise UsageError("prefill needs at least one token")
        out = []
        n, seg = ids.size, self.segment
        cuts = sorted({*range(seg, n, seg), *(int(b) for b in boundaries if 0 < b < n), n})
        segments = len(cuts)
        for j, (a, b) in enumerate(zip([0, *cuts[:-1]], cuts, strict=True)):
            part = ids[a:b]
            want_logits = not last_only or b >= n
            hook = None
            if on_layer is not None:
                hook = lambda i, j=j, a=a, t=part.size: on_layer(
                    PrefillStep(i + 1, self.cfg.n_layers, j + 1, segments, a, t, n)
                )
            out.append(self._forward(part, logits=want_logits, last_only=last_only, after_layer=hook))
            if progress is not None:
                progress(a + part.size)
        return out[-1][-1] if last_only else np.concatenate(out)

    def step(self, token_id: int) -> np.ndarray:
        """Feed one token: logits (vocab,) float32."""
        return self._forward(self._check_ids([token_id]), logits=True, last_only=False)[0]

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
    ) -> Iterator[int]:
        """Prefill `prompt_ids`, then yield up to `max_new_tokens` tokens chosen by `pick(logits)`
        (default: greedy, ties to the lower id); stop after a token in `stop_ids`, or when
        feeding the token would take the session past `max_pos` positions.

        Every yielded token but the last has been fed; the last one has not (no forward pass
        is spent on logits nobody reads): a later turn starts by feeding it. `stop_reason` then
        says why it ended (STOP_REASONS; "interrupted" when the caller closed the generator or
        a forward pass raised). A token's hash-layer experts are prefetched as soon as it is
        picked, while the caller handles it, once per forward pass. `progress` and `on_layer`
        and `boundaries` go to `prefill`."""
        pick = pick or greedy
        self.stop_reason = "interrupted"
        logits = self.prefill(prompt_ids, last_only=True, progress=progress, on_layer=on_layer, boundaries=boundaries)
        if max_new_tokens <= 0:
            self.stop_reason = "gen_limit"
            return
        for n in range(max_new_tokens):
            tok = pick(logits)
            stop = _stop_reason(tok in stop_ids, max_pos is not None and self.pos >= max_pos, n + 1 == max_new_tokens)
            if stop is not None:
                self.stop_reason = stop
                yield tok
                return
            self._prefetch_hash_layers(np.array([tok], dtype=np.int64))
            yield tok
            logits = self.step(tok)

    def snapshot(self) -> SessionState:
        """An immutable copy of this session's state (position, rings, compressed rows)."""
        return capture(self.pos, self.state)

    def restore(self, snap: SessionState) -> None:
        """Continue from `snap`: the next logits equal those of the session it was taken from."""
        if len(snap.layers) != self.cfg.n_layers:
            raise UsageError(f"a state of {len(snap.layers)} layers cannot restore a {self.cfg.n_layers}-layer session")
        self.state, self.pos = thaw(snap), snap.pos

    # ---- internals -------------------------------------------------------------
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
    ) -> np.ndarray | None:
        """One segment through every layer: attention in sub-chunks, then one MoE pass."""
        cfg, eng = self.cfg, self.engine
        t, c = ids.size, min(self.chunk_size, ids.size)
        positions = np.arange(self.pos, self.pos + t, dtype=np.int64)
        # the embedding rows first: asked for after the hash layers' experts, their reads queued
        # behind ~0.9 GB of expert reads (flash-experts, 1024 tokens: 0.32 s against 0.1-0.2 s)
        emb = eng.trunk.embed(ids)
        if self._hash_prefetched is None or not np.array_equal(self._hash_prefetched, ids):
            self._prefetch_hash_layers(ids)
        self._hash_prefetched = None
        x = np.repeat(emb[:, None, :], cfg.hc_mult, axis=1)  # (T, hc, D)
        del emb
        try:
            for i in range(cfg.n_layers):
                w = eng.trunk.layer(i)
                rope = eng.rope_for(i)

                def routed(experts: np.ndarray, layer: int = i) -> None:
                    if self.on_route is not None:
                        self.on_route(layer, positions, experts)
                    if not cfg.is_hash_layer(layer):
                        eng.experts.prefetch([(layer, int(e)) for e in np.unique(experts)])

                try:
                    for a in range(0, t, c):
                        n = min(c, t - a)
                        # one query, or a product too small to split: BLAS threads only wait
                        small = n == 1 or attend_macs(cfg, cfg.ratio(i), n, self.pos + a + n) < ONE_THREAD_MACS
                        with one_thread(small):
                            x[a : a + c] = attention_half(
                                x[a : a + c], positions[a : a + c], w, self.state[i], cfg, rope, self.trace
                            )
                    x = ffn_half(x, ids, w, cfg, self._experts_of(i), routed, self.trace, rows=c)
                except NumericsError as e:
                    bad = nonfinite_fields(w)
                    where = (
                        f" (non-finite values in {', '.join(layer_prefix(cfg, i) + b for b in bad[:4])})" if bad else ""
                    )
                    raise NumericsError(f"layer {i}: {e}{where}; {_NAN_ADVICE}") from None
                if after_layer is not None:
                    after_layer(i)
        except BaseException:
            self.torn = True
            raise
        self.pos += t
        if not logits:
            return None
        if last_only:
            x = x[-1:]
        out = head_forward(x, eng.trunk.head(), cfg)
        if not np.isfinite(out).all():  # (T, vocab): a few µs per token next to the head's matvec
            bad = nonfinite_fields(eng.trunk.head())
            if bad:
                raise NumericsError(
                    f"the logits are NaN or infinite: the head's {', '.join(bad[:4])} hold NaN/inf; {_NAN_ADVICE}"
                )
            raise NumericsError(
                f"the logits (head.weight, after layer {cfg.n_layers - 1}) are NaN or infinite; {_NAN_ADVICE}"
            )
        return out

    def _experts_of(self, layer: int) -> Callable[[np.ndarray], Iterator[tuple[int, ExpertWeights]]]:
        """The MoE's expert source for one layer: the provider's `get_many` (in memory first,
        misses as they land) where it has one, else one `get` per expert in id order."""
        experts = self.engine.experts

        def each(ids: np.ndarray) -> Iterator[tuple[int, ExpertWeights]]:
            if self.requests is not None:
                self.requests.extend((layer, int(e)) for e in ids)
            many = getattr(experts, "get_many", None)
            if many is not None:
                yield from many(layer, [int(e) for e in ids])
            else:
                for e in ids:
                    yield int(e), experts.get(layer, int(e))

        return each

    def _prefetch_hash_layers(self, ids: np.ndarray) -> None:
        """Hash layers' experts are known from the tokens alone: ask for the whole segment's up
        front, once (the next forward pass of exactly `ids` does not ask again)."""
        self._hash_prefetched = ids
        keys: list[ExpertKey] = []
        for i in range(min(self.cfg.num_hash_layers, self.cfg.n_layers)):
            tid2eid = self.engine.trunk.tid2eid(i)  # not layer(i): a streamed trunk reads layers in order
            keys += [(i, int(e)) for e in np.unique(tid2eid[ids])]
        if keys:
            self.engine.experts.prefetch(keys)
