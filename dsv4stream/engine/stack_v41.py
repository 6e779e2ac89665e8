"""DeepSeek-V4.1's layer stack, as a `Session` runs it: state, reads ahead, one layer, the head.

Owns: what is V4.1's in a forward pass: the state (per layer a window; per KV source its open
group, compressed rows and index keys; the index-key board; the Engram n-gram history), the
Engram rows asked for as soon as the token ids are known, the hyper-connection pre carried from
sublayer to sublayer, the row choices published per attention sub-chunk, and the options that
make V4.1 runs differ (`V41Options`: numerics, index keys). The segment loop, hooks and errors
are the session's; the math is `model`'s; where rows and weights come from is the providers'.

Prefill is layer-major in segments as for V4, and exact whatever the segment and sub-chunk:
an index source publishes its choice per sub-chunk, so the layers after it read the choice made
for the same queries; a KV source keeps its open group (ratio 2) between passes; the Engram
history (the last n-gram size - 1 token classes) carries the hash across passes.

Images (`SpanRows`, built by `engine.images`): the span positions' input rows replace the
embedding, their tokens route with `gate.bias_vl`, the Engram adds nothing on them and no
n-gram crosses them (DeepSeek's `Transformer.forward` with token types).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..checkpoint.config import V41, ModelConfig
from ..errors import CheckpointError, Dsv4Error, UsageError
from ..model.rope import Rope, rope_tables
from ..model.v41.attention import KeyBoard, Published, V41Plan, new_layer_state
from ..model.v41.block import HcParams, attention_half, attention_half_rows, ffn_half, head_forward, identity_pre
from ..model.v41.engram import engram
from ..model.v41.moe import V41MoeParams
from ..model.v41.quant import FP32, OFFICIAL, Numerics
from ..weights.providers import CatalogEngramRows, EngramRows, Experts, Trunk
from . import numerics as run_numerics
from .steps import Pass, PassContext

INDEX_KEYS = ("owner", "as-shipped")


@dataclass(frozen=True)
class V41Options:
    """How a V4.1 engine computes: `numerics` (`engine.numerics`: "official", the activation and
    KV grids of the release; "exact" or its alias "fp32", none; "fast", none and the fast kernels;
    None: the engine's choice, official unless it is given one); `index_keys` "owner" (each index
    source scores its own KV source's keys, so prefill and decode agree) or "as-shipped"
    (DeepSeek's decode: see `model.v41.attention`)."""

    numerics: str | None = None
    index_keys: str = "owner"

    def __post_init__(self) -> None:
        if self.numerics is not None:
            run_numerics.canonical(self.numerics)
        if self.index_keys not in INDEX_KEYS:
            raise UsageError(f"--index-keys {self.index_keys!r}: use {' or '.join(INDEX_KEYS)}")

    @property
    def grid(self) -> Numerics:
        mode = run_numerics.canonical(self.numerics or run_numerics.DEFAULTS[V41])
        return OFFICIAL if run_numerics.v41_grids(mode) else FP32

    @property
    def v4_compatible(self) -> bool:
        """What a V4 checkpoint can run: each source's own keys (the numerics are both families')."""
        return self.index_keys == "owner"


class EngramIds:
    """Token ids -> Engram table row ids, through the tokenizer's class map and the hash layout
    (`dsv4stream.engram`). `rows(history, ids)` -> ((T, n_engram_layers, columns) int64, the
    history after the ids)."""

    def __init__(self, layout, classes) -> None:
        self.layout = layout  # engram.HashLayout
        self.classes = classes  # engram.TokenClasses

    def rows(
        self, history: tuple[int, ...], ids: np.ndarray, live: np.ndarray | None = None
    ) -> tuple[np.ndarray, tuple[int, ...]]:
        from ..engram import row_ids

        return row_ids(self.layout, self.classes.of(ids), tuple(history), live)


def checkpoint_engram_ids(cat) -> EngramIds:
    """The Engram hash of a checkpoint: its own tokenizer.json's class map, the config's layout
    (checked against the tables' row counts and the class count)."""
    import tokenizers

    from ..engram import HashLayout, check_class_count, token_classes

    e = cat.config.engram
    path = Path(cat.root) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(
            f"{cat.root}: no tokenizer.json; a DeepSeek-V4.1 checkpoint hashes its tokens with its own"
            " tokenizer (Engram): put the release's tokenizer.json there"
        )
    classes = token_classes(tokenizers.Tokenizer.from_file(str(path)))
    check_class_count(classes, e.compressed_vocab_size, str(path))
    pad = int(classes.of(np.array([e.pad_token_id]))[0])
    layout = HashLayout.build(e.layer_ids, e.max_ngram_size, e.n_heads, e.vocab_size, classes.n_classes, pad)
    layout.check_table_rows(e.rows)
    return EngramIds(layout, classes)


def engram_pieces(provider: EngramRows, layer: int, ids: np.ndarray, chunk: int) -> Iterator[np.ndarray]:
    """The rows of ids (T, columns) in pieces of `chunk` tokens: through the provider's
    `rows_chunks` where it has one (one read of the segment's rows, dequantised per piece),
    else one `rows` call per piece."""
    pieces = getattr(provider, "rows_chunks", None)
    if pieces is not None:
        yield from pieces(layer, ids, chunk)
        return
    for a in range(0, ids.shape[0], chunk):
        yield provider.rows(layer, ids[a : a + chunk])


@dataclass(frozen=True)
class SpanRows:
    """One pass's image spans: types (T,) int64 (-1 text, >= 0 inside a span) and the span
    positions' input rows (their count, D) float32, in order."""

    types: np.ndarray
    rows: np.ndarray

    @property
    def mask(self) -> np.ndarray:
        return self.types >= 0

    def part(self, a: int, b: int) -> SpanRows:
        """The tokens a:b of the pass."""
        k = int(np.count_nonzero(self.types[:a] >= 0))
        n = int(np.count_nonzero(self.types[a:b] >= 0))
        return SpanRows(self.types[a:b], self.rows[k : k + n])

    def fill(self, emb: np.ndarray) -> np.ndarray:
        """The embedding rows (T, D) with the span rows written in."""
        emb[self.mask] = self.rows
        return emb


@dataclass
class Carry:
    """Session state beside the layers': the index-key board and the Engram n-gram history, with
    the facts a state file's copy is checked against (the fresh carry's)."""

    board: KeyBoard = field(default_factory=KeyBoard)
    history: tuple[int, ...] = ()  # the last classes the Engram hash looks back on
    look_back: int = 0  # the most classes `history` holds (the Engram's n-gram size - 1)
    layers: int = 0  # the board's publisher is one of them
    classes: int = 0  # the Engram's class count: each class of `history` is below it
    keyed: tuple[tuple[int, int], ...] = ()  # (layer, ratio) of the KV sources that publish index keys

    def check_restored(self, fresh: Carry, pos: int) -> str | None:
        """What is wrong with this carry, read from a state file, after `pos` tokens (None: fine)."""
        facts = (self.look_back, self.layers, self.classes, self.keyed)
        want = (fresh.look_back, fresh.layers, fresh.classes, fresh.keyed)
        if facts != want:
            return f"a carry for (classes back, layers, classes, keyed sources) {facts}, expected {want}"
        if len(self.history) > min(pos, self.look_back) or any(not 0 <= c < self.classes for c in self.history):
            return f"an Engram history of {len(self.history)} classes after {pos} tokens, at most {self.look_back}"
        # the publisher is the last keyed source that emitted a row: -1 only before any emitted
        emitted = [layer for layer, ratio in self.keyed if pos >= ratio]
        if self.board.publisher not in (emitted or [-1]):
            return f"index keys published by layer {self.board.publisher} after {pos} tokens"
        return None


@dataclass
class V41Pass(Pass):
    pre: np.ndarray = None  # (T, hc): the pre the next sublayer collapses the streams with
    rows: np.ndarray | None = None  # (T, n_engram_layers, columns) Engram row ids
    history: tuple[int, ...] = ()  # the Engram history after this pass
    published: list[Published] = field(default_factory=list)  # per attention sub-chunk
    image: np.ndarray | None = None  # (T,) bool: image-span tokens (None: none)
    a_pre: np.ndarray | None = None  # (T, hc): the FFN's pre, from attention to the MoE half

    def cut(self, first: int) -> None:
        """Keep rows first: only (`Pass.cut`), with what the pass carries per row."""
        super().cut(first)
        self.pre, self.a_pre = self.pre[first:], self.a_pre[first:]
        self.image = None if self.image is None else self.image[first:]
        self.rows = None if self.rows is None else self.rows[first:]


class V41Stack:
    """V4.1's part of a forward pass (see the module docstring)."""

    family = V41

    def __init__(
        self,
        cfg: ModelConfig,
        trunk: Trunk,
        experts: Experts,
        engram_rows: EngramRows | None,
        engram_ids: EngramIds | None,
        options: V41Options,
    ) -> None:
        self.cfg = cfg
        self.trunk = trunk
        self.experts = experts
        self.engram_rows = engram_rows
        self.engram_ids = engram_ids
        self.options = options
        sh = cfg.shared
        n = cfg.n_layers
        quantise = options.grid.quantise
        self.plan = V41Plan.build(
            cfg.compress_ratios[:n],
            sh.kv_sources,
            sh.index_sources,
            sh.candidate_source,
            candidate_block=sh.candidate_block_size,
            candidate_topk_blocks=sh.candidate_topk_blocks,
            n_heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            window=cfg.sliding_window,
            index_n_heads=cfg.index_n_heads,
            index_topk=cfg.index_topk,
            eps=cfg.rms_norm_eps,
            quantise=quantise,
            stale_keys=options.index_keys == "as-shipped",
        )
        self.hc = HcParams(cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.moe = V41MoeParams(
            cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit, cfg.norm_topk_prob, quantise
        )
        self.rope_main, self.rope_comp = rope_tables(cfg)
        self.engram_layers = cfg.engram.layer_ids if cfg.engram is not None else ()
        if self.engram_layers and (engram_rows is None or engram_ids is None):
            raise UsageError("a DeepSeek-V4.1 engine needs its Engram rows and hash (the checkpoint's tokenizer)")

    def rope_for(self, layer: int) -> Rope:
        return self.rope_comp if self.cfg.ratio(layer) else self.rope_main

    def new_state(self) -> list:
        layers = [new_layer_state(self.plan, i, self.cfg.index_head_dim) for i in range(self.cfg.n_layers)]
        e = self.cfg.engram
        look_back, classes = (e.max_ngram_size - 1, e.compressed_vocab_size) if e is not None else (0, 0)
        keyed = tuple((i, s.source.ratio) for i, s in enumerate(layers) if s.source is not None and s.source.keyed)
        return [*layers, Carry(look_back=look_back, layers=self.cfg.n_layers, classes=classes, keyed=keyed)]

    def read_ahead(
        self, ids: np.ndarray, state: list, spans: SpanRows | None = None
    ) -> tuple[np.ndarray, tuple[int, ...]] | None:
        """The Engram row ids of `ids` (from the history in `state`; image-span tokens cut the
        n-grams), with their reads started."""
        if not self.engram_layers:
            return None
        carry: Carry = state[-1]
        rows, history = self.engram_ids.rows(carry.history, ids, None if spans is None else ~spans.mask)
        for k, layer in enumerate(self.engram_layers):
            self.engram_rows.prefetch(layer, rows[:, k])
        return rows, history

    def begin(
        self,
        ids: np.ndarray,
        positions: np.ndarray,
        state: list,
        ahead: Callable[[], object],
        spans: SpanRows | None = None,
    ) -> V41Pass:
        got = ahead()  # the Engram reads first: layer 1 needs them after one layer
        emb = self.trunk.embed(ids)
        if spans is not None:
            emb = spans.fill(np.array(emb, dtype=np.float32))
        x = np.repeat(emb[:, None, :], self.cfg.hc_mult, axis=1)
        p = V41Pass(ids, positions, x, pre=identity_pre(ids.size, self.cfg.hc_mult))
        p.image = None if spans is None else spans.mask
        if got is not None:
            p.rows, p.history = got
        return p

    def layer(self, ctx: PassContext, p: V41Pass, i: int, w, state: list, keep: int | None = None) -> None:
        """Layer i: Engram (on its layers), attention in sub-chunks, then one MoE pass. keep: only the
        outputs of the pass's last `keep` rows are wanted (None: all; see `Stack.layer`)."""
        self.attend(ctx, p, i, w, state, keep)
        if p.ids.size:
            self.ffn(ctx, p, i, w)

    def attend(self, ctx: PassContext, p: V41Pass, i: int, w, state: list, keep: int | None = None) -> None:
        """Layer i's first half, the one that reads and updates the sequence's state: Engram (on
        its layers) and attention in sub-chunks; leaves the FFN's pre in `p.a_pre`. With `keep`,
        every row updates the state and the pass is cut to its last `keep` rows."""
        cfg, t = self.cfg, p.ids.size
        carry: Carry = state[-1]
        layers = state[:-1]
        c, rope = min(ctx.chunk, t), self.rope_for(i)
        if w.engram is not None:
            # per sub-chunk: a whole segment's rows at once would be S x columns x head_dim floats
            # and their projection S x (hc + 1) x D (~0.5 GB at S = 4096 on the release), which
            # the plan does not hold; each token's gate reads only its own rows and streams
            k = self.engram_layers.index(i)
            for a, rows in zip(range(0, t, c), engram_pieces(self.engram_rows, i, p.rows[:, k], c), strict=True):
                b = min(t, a + c)
                live = None if p.image is None else ~p.image[a:b]
                p.x[a:b] = engram(p.x[a:b], rows, w.engram, cfg.rms_norm_eps, self.plan.quantise, live)
        if ctx.trace is not None:  # the streams entering the layer: the DSpark drafter's taps
            ctx.trace("input", i, p.x)
        if not p.published:
            p.published = [Published() for _ in range(0, t, c)]
        p.a_pre = np.empty_like(p.pre)
        x = p.x
        first = max(t - keep, 0) if keep is not None else 0  # the first row whose output is wanted
        for j, a in enumerate(range(0, t, c)):
            b = min(t, a + c)
            out_from = min(max(first - a, 0), b - a)
            x[a + out_from : b], p.a_pre[a + out_from : b] = attention_half(
                x[a:b], p.pre[a:b], p.positions[a:b], w, layers, self.plan, p.published[j], carry.board, rope, self.hc,
                out_from,
            )  # fmt: skip
        if i == cfg.n_layers - 1:
            carry.history = tuple(p.history)
        if first:
            p.cut(first)

    def attend_rows(self, passes: list[V41Pass], i: int, w, states: list[list], traces=None) -> V41Pass:
        """`attend` of one decode token per sequence (passes[b] of states[b]; traces[b], where
        given and not None, sees its row entering the layer, as `attend`'s trace), the mixes and
        the attention's projections once over the rows (`attention_half_rows`); the Engram and
        each sequence's state row by row: the passes joined, as `join`."""
        for b, (p, state) in enumerate(zip(passes, states, strict=True)):
            if w.engram is not None:
                rows = next(engram_pieces(self.engram_rows, i, p.rows[:, self.engram_layers.index(i)], 1))
                live = None if p.image is None else ~p.image
                p.x = engram(p.x, rows, w.engram, self.cfg.rms_norm_eps, self.plan.quantise, live)
            if traces is not None and traces[b] is not None:
                traces[b]("input", i, p.x)
            if not p.published:
                p.published = [Published()]
        joined = self.join(passes)
        rows = [(state[:-1], p.published[0], state[-1].board) for p, state in zip(passes, states, strict=True)]
        joined.x, joined.a_pre = attention_half_rows(
            joined.x, joined.pre, joined.positions, w, rows, self.plan, self.rope_for(i), self.hc
        )
        if i == self.cfg.n_layers - 1:
            for p, state in zip(passes, states, strict=True):
                state[-1].history = tuple(p.history)
        return joined

    def ffn(self, ctx: PassContext, p: V41Pass, i: int, w) -> None:
        """Layer i's second half, stateless and row by row: one MoE pass over the pass's tokens
        (those of several sequences in a batched pass, `engine.batch`)."""
        hook = ctx.routed(i, p.positions)
        rows = min(ctx.chunk, p.ids.size)
        p.x, p.pre = ffn_half(p.x, p.a_pre, w, ctx.experts(i), self.moe, self.hc, hook, rows=rows, image=p.image)

    def join(self, passes: list[V41Pass]) -> V41Pass:
        """One pass holding the rows of `passes` in order (for the stateless half and the head)."""
        cat = np.concatenate
        joined = V41Pass(
            cat([p.ids for p in passes]), cat([p.positions for p in passes]), cat([p.x for p in passes]),
            pre=cat([p.pre for p in passes]),
        )  # fmt: skip
        if passes[0].a_pre is not None:
            joined.a_pre = cat([p.a_pre for p in passes])
        if any(p.image is not None for p in passes):
            joined.image = cat([np.zeros(p.ids.size, bool) if p.image is None else p.image for p in passes])
        return joined

    def split(self, joined: V41Pass, passes: list[V41Pass]) -> None:
        """The rows of `joined` back into the passes it was joined from."""
        a = 0
        for p in passes:
            b = a + p.ids.size
            p.x, p.pre, p.a_pre = joined.x[a:b], joined.pre[a:b], None
            a = b

    def logits(self, p: V41Pass, last_only: bool, extra: np.ndarray | None = None) -> np.ndarray:
        x, pre = (p.x[-1:], p.pre[-1:]) if last_only else (p.x, p.pre)
        return head_forward(x, pre, self.trunk.head(), self.cfg.rms_norm_eps, extra)

    def head_weights(self):
        return self.trunk.head()

    def agrees(self, state: list, ids: Sequence[int]) -> str | None:
        """The Engram history must be the classes of the last ids (as many as it holds: an image
        span cuts it, so it may hold fewer than the n-gram looks back on)."""
        carry: Carry = state[-1]
        if not carry.history or self.engram_ids is None:
            return None
        tail = np.asarray(ids[len(ids) - len(carry.history) :], dtype=np.int64)
        try:
            want = tuple(int(c) for c in self.engram_ids.classes.of(tail))
        except Dsv4Error as e:
            return f"token ids the tokenizer does not have ({e})"
        if carry.history != want:
            return f"an Engram history {carry.history} that is not the classes {want} of its last token ids"
        return None


def build(
    cfg: ModelConfig,
    trunk: Trunk,
    experts: Experts,
    catalog=None,
    *,
    engram_rows: EngramRows | None = None,
    engram_ids: EngramIds | None = None,
    v41: V41Options | None = None,
) -> V41Stack:
    """V4.1's stack for an `Engine`: the Engram rows and hash default to the catalog's (read on
    demand) and its tokenizer.json's; the options to the release's numerics and owner keys."""
    if cfg.engram is not None and catalog is not None:
        engram_rows = engram_rows or CatalogEngramRows(catalog)
        engram_ids = engram_ids or checkpoint_engram_ids(catalog)
    return V41Stack(cfg, trunk, experts, engram_rows, engram_ids, v41 or V41Options())
