"""One transformer block and the head, on the hc_mult residual streams.

Owns: the order of operations inside a layer (mHC pre -> attn_norm -> attention -> mHC
post -> mHC pre -> ffn_norm -> MoE -> mHC post; the FFN half reads the streams as the
attention half left them) and the head (hc_head collapse -> norm -> head). Weights and
state come in; nothing is looked up by name.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..config import ModelConfig
from ..kernels import matmul
from .attention import AttnState, attention
from .mhc import hc_head, hc_post, hc_pre
from .moe import ExpertWeights, moe
from .ops import rms_norm
from .rope import Rope
from .weights import HeadWeights, LayerWeights

# trace(what, layer, array): what is "attn" (T, D), "ffn" (T, D), "hidden" (T, hc, D) after the
# layer, or "index" (T, K) the indexer's rows at ratio-4 layers (-1 = none)
Trace = Callable[[str, int, np.ndarray], None]


def layer_forward(
    x: np.ndarray,
    token_ids: np.ndarray,
    positions: np.ndarray,
    w: LayerWeights,
    st: AttnState,
    cfg: ModelConfig,
    rope: Rope,
    get_expert: Callable[[int], ExpertWeights],
    on_route: Callable[[np.ndarray], None] | None = None,
    trace: Trace | None = None,
) -> np.ndarray:
    """Streams x (T, hc, D) of tokens token_ids (T,) at positions (T,) -> new streams (T, hc, D)."""
    it, hc_eps, eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
    h, post, comb = hc_pre(x, w.hc_attn, it, hc_eps, eps)
    on_index = (lambda idx: trace("index", w.index, idx)) if trace else None
    y = attention(rms_norm(h, w.attn_norm, eps), positions, w.attn, st, cfg, rope, on_index)
    if trace:
        trace("attn", w.index, y)
    x = hc_post(x, y, post, comb)

    h, post, comb = hc_pre(x, w.hc_ffn, it, hc_eps, eps)
    y = moe(
        rms_norm(h, w.ffn_norm, eps),
        token_ids,
        w.moe,
        get_expert,
        cfg.num_experts_per_tok,
        cfg.routed_scaling_factor,
        cfg.swiglu_limit,
        on_route,
    )
    if trace:
        trace("ffn", w.index, y)
    x = hc_post(x, y, post, comb)
    if trace:
        trace("hidden", w.index, x)
    return x


def head_forward(x: np.ndarray, w: HeadWeights, cfg: ModelConfig) -> np.ndarray:
    """Streams x (T, hc, D) -> logits (T, vocab)."""
    h = hc_head(x, w.hc, cfg.hc_eps, cfg.rms_norm_eps)
    return matmul(w.head, rms_norm(h, w.norm, cfg.rms_norm_eps))
