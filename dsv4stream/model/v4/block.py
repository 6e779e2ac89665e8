"""One transformer block and the head, on the hc_mult residual streams.

Owns: the order of operations inside a layer (mHC pre -> attn_norm -> attention -> mHC
post -> mHC pre -> ffn_norm -> MoE -> mHC post; the FFN half reads the streams as the
attention half left them) and the head (hc_head collapse -> norm -> head). Weights and
state come in; nothing is looked up by name. The two halves are separate calls so that a
prefill segment can run attention in sub-chunks and the MoE over the whole segment.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...checkpoint.config import ModelConfig
from ...kernels.head import head_logits
from ..mhc import hc_head, hc_post, hc_pre
from ..moe import ExpertSource, moe
from ..ops import rms_norm
from ..rope import Rope
from ..trace import Trace
from .attention import AttnState, attention, attention_rows
from .layer import HeadWeights, LayerWeights


def attention_half(
    x: np.ndarray,
    positions: np.ndarray,
    w: LayerWeights,
    st: AttnState,
    cfg: ModelConfig,
    rope: Rope,
    trace: Trace | None = None,
    out_from: int = 0,
) -> np.ndarray:
    """Streams x (T, hc, D) at positions (T,) -> streams after the attention half of rows
    out_from: (T - out_from, hc, D); updates st with all T rows (`attention`'s out_from).

    Tokens must come in order: the state holds every earlier position of the sequence."""
    it, hc_eps, eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
    h, post, comb = hc_pre(x, w.hc_attn, it, hc_eps, eps, w.attn_norm)
    on_index = (lambda idx: trace("index", w.index, idx)) if trace else None
    y = attention(h, positions, w.attn, st, cfg, rope, on_index, out_from)
    if trace:
        trace("attn", w.index, y)
    return hc_post(x[out_from:], y, post[out_from:], comb[out_from:])


def attention_half_rows(
    x: np.ndarray, positions: np.ndarray, w: LayerWeights, states: list[AttnState], cfg: ModelConfig, rope: Rope
) -> np.ndarray:
    """One decode token of each of B sequences: streams x (B, hc, D) at positions (B,), row b's
    state states[b] -> streams after the attention half, row b bit for bit `attention_half` of
    that row alone. The mHC mixing, the norm and the attention's projections run once over the
    B rows (`attention_rows`); the state's part row by row."""
    it, hc_eps, eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
    h, post, comb = hc_pre(x, w.hc_attn, it, hc_eps, eps, w.attn_norm)
    y = attention_rows(h, positions, w.attn, states, cfg, rope)
    return hc_post(x, y, post, comb)


def ffn_half(
    x: np.ndarray,
    token_ids: np.ndarray,
    w: LayerWeights,
    cfg: ModelConfig,
    each: ExpertSource,
    on_route: Callable[[np.ndarray], None] | None = None,
    trace: Trace | None = None,
    rows: int | None = None,
) -> np.ndarray:
    """Streams x (T, hc, D) of tokens token_ids (T,) -> streams after the MoE half, written into x.

    One MoE pass over all T tokens (each routed expert fetched once); the per-token mHC
    mixing before and after it runs `rows` tokens at a time to bound its temporaries."""
    it, hc_eps, eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
    t = x.shape[0]
    rows = rows or t
    if rows >= t:  # one chunk (every decode step): its arrays as they come, no copies into buffers
        h, post, comb = hc_pre(x, w.hc_ffn, it, hc_eps, eps, w.ffn_norm)
    else:
        h = np.empty((t, cfg.hidden_size), dtype=np.float32)
        post = np.empty((t, cfg.hc_mult), dtype=np.float32)
        comb = np.empty((t, cfg.hc_mult, cfg.hc_mult), dtype=np.float32)
        for a in range(0, t, rows):
            b = min(t, a + rows)
            h[a:b], post[a:b], comb[a:b] = hc_pre(x[a:b], w.hc_ffn, it, hc_eps, eps, w.ffn_norm)
    k, scale, limit = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit
    y = moe(h, token_ids, w.moe, each, k, scale, limit, on_route)
    del h
    if trace:
        trace("ffn", w.index, y)
    for a in range(0, t, rows):
        b = min(t, a + rows)
        x[a:b] = hc_post(x[a:b], y[a:b], post[a:b], comb[a:b])
    if trace:
        trace("hidden", w.index, x)
    return x


def head_forward(x: np.ndarray, w: HeadWeights, cfg: ModelConfig, extra: np.ndarray | None = None) -> np.ndarray:
    """Streams x (T, hc, D) -> logits (T, vocab); `extra` (n, D): rows already normed that go
    through the same head call, their logits after the T rows (T + n, vocab)."""
    h = hc_head(x, w.hc, cfg.hc_eps, cfg.rms_norm_eps)
    return head_logits(w.head, w.q8, rms_norm(h, w.norm, cfg.rms_norm_eps), extra)
