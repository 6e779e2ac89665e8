"""DeepSeek-V4's layer stack, as a `Session` runs it: state, reads ahead, one layer, the head.

Owns: what is V4's in a forward pass (the per-layer `AttnState`s, the hash layers' experts
prefetched from the token ids alone, attention in sub-chunks, the MoE half, the hc_head
collapse). The segment loop, hooks, error handling and the public API are the session's
(`engine.session`); the math is `model`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..checkpoint.config import V4, ModelConfig
from ..errors import UsageError
from ..model.rope import rope_tables
from ..model.v4.attention import AttnState, new_attn_state
from ..model.v4.block import attention_half, attention_half_rows, ffn_half, head_forward
from ..weights.providers import ExpertKey, Experts, Trunk
from .steps import Pass, PassContext


class V4Stack:
    """V4's part of a forward pass (see the module docstring)."""

    family = V4

    def __init__(self, cfg: ModelConfig, trunk: Trunk, experts: Experts) -> None:
        self.cfg = cfg
        self.trunk = trunk
        self.experts = experts
        self.rope_main, self.rope_comp = rope_tables(cfg)

    def rope_for(self, layer: int):
        return self.rope_comp if self.cfg.ratio(layer) else self.rope_main

    def new_state(self) -> list[AttnState]:
        return [new_attn_state(self.cfg, i) for i in range(self.cfg.n_layers)]

    def read_ahead(self, ids: np.ndarray, state: list) -> None:
        """Hash layers' experts are known from the tokens alone: ask for all of them now."""
        keys: list[ExpertKey] = []
        for i in range(min(self.cfg.num_hash_layers, self.cfg.n_layers)):
            tid2eid = self.trunk.tid2eid(i)  # not layer(i): a streamed trunk reads layers in order
            keys += [(i, int(e)) for e in np.unique(tid2eid[ids])]
        if keys:
            self.experts.prefetch(keys)

    def begin(self, ids: np.ndarray, positions: np.ndarray, state: list, ahead: Callable[[], object]) -> Pass:
        """The embedding rows repeated into hc_mult streams (T, hc, D)."""
        # the embedding rows first: asked for after the hash layers' experts, their reads queued
        # behind ~0.9 GB of expert reads (flash-experts, 1024 tokens: 0.32 s against 0.1-0.2 s)
        emb = self.trunk.embed(ids)
        ahead()
        return Pass(ids, positions, np.repeat(emb[:, None, :], self.cfg.hc_mult, axis=1))

    def layer(self, ctx: PassContext, p: Pass, i: int, w, state: list, keep: int | None = None) -> None:
        """Layer i on the pass's streams: attention in sub-chunks, then one MoE pass. keep: only the
        outputs of the pass's last `keep` rows are wanted (None: all; see `Stack.layer`)."""
        self.attend(ctx, p, i, w, state, keep)
        if p.ids.size:
            self.ffn(ctx, p, i, w)

    def attend(self, ctx: PassContext, p: Pass, i: int, w, state: list, keep: int | None = None) -> None:
        """Layer i's first half, the one that reads and updates the sequence's state: attention
        in sub-chunks of the pass's streams. With `keep`, every row updates the state and the
        pass is cut to its last `keep` rows."""
        x, t = p.x, p.ids.size
        c, rope = min(ctx.chunk, t), self.rope_for(i)
        if ctx.trace is not None:  # the streams entering the layer: the 0731 DSpark drafter's taps
            ctx.trace("input", i, x)
        first = max(t - keep, 0) if keep is not None else 0  # the first row whose output is wanted
        for a in range(0, t, c):
            out_from = min(max(first - a, 0), c)
            y = attention_half(x[a : a + c], p.positions[a : a + c], w, state[i], self.cfg, rope, ctx.trace, out_from)
            x[a + out_from : a + c] = y
        if first:
            p.cut(first)

    def attend_rows(self, passes: list[Pass], i: int, w, states: list[list], traces=None) -> Pass:
        """`attend` of one decode token per sequence (passes[b] of states[b]; traces[b], where
        given and not None, sees its row entering the layer, as `attend`'s trace), the
        projections run once over the rows (`attention_half_rows`): the passes joined, as `join`."""
        for p, trace in zip(passes, traces or [None] * len(passes), strict=True):
            if trace is not None:
                trace("input", i, p.x)
        joined = self.join(passes)
        joined.x = attention_half_rows(
            joined.x, joined.positions, w, [st[i] for st in states], self.cfg, self.rope_for(i)
        )
        return joined

    def ffn(self, ctx: PassContext, p: Pass, i: int, w) -> None:
        """Layer i's second half, stateless and row by row: one MoE pass over the pass's tokens
        (those of several sequences in a batched pass, `engine.batch`)."""
        hook = ctx.routed(i, p.positions, prefetch=not self.cfg.is_hash_layer(i))
        p.x = ffn_half(p.x, p.ids, w, self.cfg, ctx.experts(i), hook, ctx.trace, rows=min(ctx.chunk, p.ids.size))

    def join(self, passes: list[Pass]) -> Pass:
        """One pass holding the rows of `passes` in order (for the stateless half and the head)."""
        cat = np.concatenate
        return Pass(cat([p.ids for p in passes]), cat([p.positions for p in passes]), cat([p.x for p in passes]))

    def split(self, joined: Pass, passes: list[Pass]) -> None:
        """The rows of `joined` back into the passes it was joined from."""
        a = 0
        for p in passes:
            p.x = joined.x[a : a + p.ids.size]
            a += p.ids.size

    def logits(self, p: Pass, last_only: bool, extra: np.ndarray | None = None) -> np.ndarray:
        x = p.x[-1:] if last_only else p.x
        return head_forward(x, self.trunk.head(), self.cfg, extra)

    def head_weights(self):
        return self.trunk.head()

    def agrees(self, state: list, ids: Sequence[int]) -> str | None:
        return None  # nothing of V4's state derives from the ids but through the position


def build(cfg: ModelConfig, trunk: Trunk, experts: Experts, catalog=None, *, v41=None, **_v41_inputs) -> V4Stack:
    """V4's stack for an `Engine`. V4.1's inputs (Engram rows and hash) have nothing to feed; its
    options (`V41Options`) are refused unless they ask for what V4 runs anyway (the numerics
    are both families': the engine applies them)."""
    if v41 is not None and not v41.v4_compatible:
        raise UsageError(
            "--index-keys is a DeepSeek-V4.1 option: a V4 checkpoint scores each source's own keys"
            " (--index-keys owner, or leave it out)"
        )
    return V4Stack(cfg, trunk, experts)
