"""What a DeepSeek-V4.1 run holds besides weights, estimated from its config (the planner's V4.1 inputs).

Owns: per-sequence state, per-chunk staging and per-segment-token bytes for V4.1, and the
Engram row cache's unit. `planner` places them; the numbers follow the reference's data:
- state: a window ring per layer; a compressed cache and an index-key cache only on the kv
  sources (`ctx / ratio` rows of head_dim and index_head_dim floats; ratio 1 keeps one row per
  token), a ratio-2 source's open group (kv and gate of `ratio` tokens), the Engram n-gram history.
- staging: V4's terms, plus the indexer's per-head scores over every visible compressed row
  (ratio 1: every position) before the heads are summed, the candidate mask, and an Engram
  layer's rows and projection for the chunk.
- segment tokens: V4's terms, plus the Engram rows of the segment's tokens at one Engram layer
  (read before that layer, dropped after it).
"""

from __future__ import annotations

from ..checkpoint.config import ModelConfig
from ..model.compressor import row_capacity

# One Engram row in the row cache: the row (FP8 + E8M0) plus an 8-byte id and an 8-byte slot in its index.
ENGRAM_INDEX_BYTES = 16
# Rows read per batch of aligned reads (two 4 KiB pages each: the row's and its scale's).
ENGRAM_READ_BATCH = 4096


def engram_slot_bytes(cfg: ModelConfig) -> int:
    return cfg.engram.row_bytes + ENGRAM_INDEX_BYTES if cfg.engram else 0


def engram_rows_per_token(cfg: ModelConfig) -> int:
    return cfg.engram.columns * len(cfg.engram.layer_ids) if cfg.engram else 0


def state_bytes(cfg: ModelConfig, ctx: int) -> int:
    hd, ihd, w = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    sh = cfg.shared
    total = largest = 0
    for layer in range(cfg.n_layers):
        total += w * hd * 4 + w * 8
        r = cfg.ratio(layer)
        if not r or sh is None or not sh.is_kv_source(layer):
            continue
        for d in (hd, ihd):  # compressed rows, index keys
            rows = row_capacity(ctx // r + 1) * d * 4
            largest = max(largest, rows)
            total += rows
        if r > 1:
            total += 2 * r * hd * 4  # the open group's kv and gate scores
    if cfg.engram:
        total += cfg.engram.max_ngram_size * 8
    return total + largest


def staging_extra_bytes(cfg: ModelConfig, chunk: int, ctx: int) -> int:
    """What V4.1 adds to V4's staging estimate for one sub-chunk of `chunk` tokens."""
    ratios = [cfg.ratio(i) for i in range(cfg.n_layers) if cfg.ratio(i)]
    if not ratios:
        return 0
    index_rows = ctx // min(ratios) + 1
    per_tok = 4 * (cfg.index_n_heads + 2) * index_rows  # per-head scores, their sum, the candidate mask
    if cfg.engram:
        e = cfg.engram
        per_tok += 4 * (e.columns * e.head_dim + (cfg.hc_mult + 1) * cfg.hidden_size)
        per_tok += e.columns * 8
    out = chunk * per_tok
    if cfg.engram:
        out += ENGRAM_READ_BATCH * 2 * 4096  # aligned pages of one read batch
    return out


def segment_extra_bytes(cfg: ModelConfig) -> int:
    """Per segment token: its Engram rows at one Engram layer (the cache's floor)."""
    return cfg.engram.columns * engram_slot_bytes(cfg) if cfg.engram else 0
