"""What a DeepSeek-V4 run holds besides weights, estimated from its config (the planner's V4 inputs).

Owns: per-sequence state, the attention scores' staging per token, and what V4 adds to the
head's bytes (the hc_head collapse). `planner` places them; `planner_v41` answers the same
questions for V4.1. V4 has no Engram and no staging or segment terms beyond `planner`'s own.
"""

from __future__ import annotations

from ..checkpoint.config import CSA, ModelConfig
from ..model.cache import row_capacity


def state_bytes(cfg: ModelConfig, ctx: int) -> int:
    """float32 bytes of per-sequence state at `ctx` tokens: per layer the window ring (rows and
    positions); per compressed layer the compressed rows as allocated (`row_capacity`: a
    buffer grows ahead of its rows), the open window's kv and gate, the overlap's last Ca
    half; the same for the indexer's compressor at ratio 4; plus one buffer's old copy while
    it grows (layers grow one at a time)."""
    hd, ihd, w = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    total = largest = 0
    for layer in range(cfg.n_layers):
        r = cfg.ratio(layer)
        total += w * hd * 4 + w * 8
        csa = cfg.layer_kind(layer) == CSA  # overlapping windows (coff 2) and an indexer
        comps = [(hd, 2 if csa else 1)] if r else []
        if csa:
            comps.append((ihd, 2))
        for d, coff in comps:
            rows = row_capacity(ctx // r + 1) * d * 4
            largest = max(largest, rows)
            total += rows + 2 * r * coff * d * 4 + (2 * r * d * 4 if coff == 2 else 0)
    return total + largest


def score_token_bytes(cfg: ModelConfig, chunk: int, ctx: int) -> int:
    """Per sub-chunk token: the scores over the window and the compressed rows a query sees (a
    few live copies: scores, mask, softmax), and the indexer's scores over every compressed row."""
    h, w = cfg.num_attention_heads, cfg.sliding_window
    ratios = {cfg.ratio(i) for i in range(cfg.n_layers)} - {0}
    seen = max([cfg.index_topk if r == 4 else ctx // r + 1 for r in ratios], default=0)
    index_rows = ctx // 4 + 1 if 4 in ratios else 0
    return 4 * (4 * h * (w + chunk + seen + 1) + 4 * index_rows)


def staging_extra_bytes(cfg: ModelConfig, chunk: int, ctx: int) -> int:
    return 0


def segment_extra_bytes(cfg: ModelConfig) -> int:
    return 0


def head_extra_bytes(cfg: ModelConfig) -> int:
    """The hc_head collapse's weights (fn, base, scale), float32."""
    hc, d = cfg.hc_mult, cfg.hidden_size
    return hc * hc * d * 4 + 4 * hc + 4


def engram_slot_bytes(cfg: ModelConfig) -> int:
    return 0


def engram_rows_per_token(cfg: ModelConfig) -> int:
    return 0
