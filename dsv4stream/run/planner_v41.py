"""What a DeepSeek-V4.1 run holds besides weights, estimated from its config (the planner's V4.1 inputs).

Owns: per-sequence state, per-chunk staging and per-segment-token bytes for V4.1, and the
Engram row cache's unit. `planner` places them; the numbers follow the reference's data:
- state: a window ring per layer; a compressed cache and an index-key cache only on the kv
  sources (`ctx / ratio` rows of head_dim and index_head_dim floats; ratio 1 keeps one row per
  token), a ratio-2 source's open group (kv and gate of `ratio` tokens), the Engram n-gram history.
- staging: V4's terms, plus the indexer's per-head scores over every visible compressed row
  (ratio 1: every position) before the heads are summed, the candidate mask, and an Engram
  layer's rows, projection and gate for the chunk (the Engram runs per sub-chunk, so its
  temporaries never scale with the segment).
- segment tokens: V4's terms, plus the Engram rows of the segment's tokens at one Engram layer
  (read before that layer, dropped after it): in the cache, and as the one gather's row bytes.
"""

from __future__ import annotations

from ..checkpoint.config import ModelConfig
from ..model.cache import row_capacity
from ..store.rowcache import RowCache

# The Engram row cache's reads run on the expert store's reader threads, each holding one aligned
# read window (up to 1 MiB) at a time; counted for up to this many threads (--io-threads, default 4).
ENGRAM_READERS = 32
# Bytes per gathered Engram row beyond its own: the row cache's int64 keys, unique ids, inverse,
# slots and masks for the call (measured: ~140 bytes a row with tracemalloc; counted with margin).
ROW_INDEX_BYTES = 192


def engram_slot_bytes(cfg: ModelConfig) -> int:
    """One row in the row cache (`store.rowcache`): its FP8 values and scales, and its bookkeeping."""
    return RowCache.bytes_per_row_of(cfg.engram.row_bytes) if cfg.engram else 0


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


def score_token_bytes(cfg: ModelConfig, chunk: int, ctx: int) -> int:
    """Per sub-chunk token: the scores over the window and the index_topk rows every compressed
    layer sees (a few live copies: scores, mask, softmax); the indexer's are `staging_extra_bytes`."""
    h, w = cfg.num_attention_heads, cfg.sliding_window
    return 4 * (4 * h * (w + chunk + cfg.index_topk + 1))


def head_extra_bytes(cfg: ModelConfig) -> int:
    """Nothing: V4.1's head has no hc_head (the streams are collapsed with the last FFN half's pre)."""
    return 0


def staging_extra_bytes(cfg: ModelConfig, chunk: int, ctx: int) -> int:
    """What V4.1 adds to V4's staging estimate for one sub-chunk of `chunk` tokens."""
    ratios = [cfg.ratio(i) for i in range(cfg.n_layers) if cfg.ratio(i)]
    if not ratios:
        return 0
    index_rows = ctx // min(ratios) + 1
    per_tok = 4 * (cfg.index_n_heads + 2) * index_rows  # per-head scores, their sum, the candidate mask
    if cfg.engram:
        per_tok += engram_token_bytes(cfg)
    out = chunk * per_tok
    if cfg.engram:
        out += RowCache.staging_bytes(ENGRAM_READERS)  # the row cache's read windows in flight
    return out


def vision_activation_bytes(cfg: ModelConfig) -> int:
    """The vision tower's float32 activations for the largest image (`model.v41.vision`): its
    patches (max_image_tokens cells of downsample^2 patches each) times ~12 hidden rows during
    attention (x, qkv, the per-head copies, the rotated q and k and their halves, the output)
    or 3 MLP rows (w1's gate+up, silu and the product, each with its bf16 rounding temporary),
    whichever is more, plus one block of attention scores and its softmax temporary, one BF16
    weight block widened, and the aligner's cells."""
    from ..model.v41.vision import ATTN_ROWS, W_ROWS

    v = cfg.vision
    if v is None:
        return 0
    r = v.downsample_ratio
    n = v.max_image_tokens * r * r
    c, i2 = v.hidden_size, 2 * v.intermediate_size
    per_patch = 4 * max(12 * c, 2 * c + 3 * i2)
    scores = 2 * 4 * v.num_attention_heads * min(n, ATTN_ROWS) * n
    widened = 4 * min(W_ROWS, max(i2, cfg.hidden_size)) * max(c * r * r, v.intermediate_size)
    cells = 4 * v.max_image_tokens * (2 * c * r * r + 3 * cfg.hidden_size)
    return n * per_patch + scores + widened + cells


def engram_token_bytes(cfg: ModelConfig) -> int:
    """Peak bytes per token of an Engram layer's sub-chunk (`engine.stack_v41`: the rows are gathered,
    dequantised and gated one attention sub-chunk at a time, never a whole segment): the gathered
    row bytes and the row cache's index arrays (keys, unique, inverse, slots: ~192 bytes a row),
    the dequantised rows, then either the FP8 grid's temporaries of the rows (two more copies) or
    the gate's over the streams (hc x D), beside the projection (hc + 1) x D. Measured with
    tracemalloc at D 512, 2048 and 5120 (24 rows of 256): 85, 116 and 209 kB a token, against
    95, 126 and 220 kB here (tests/test_v41_engram_budget.py measures it on generated checkpoints)."""
    e = cfg.engram
    rows = e.columns * e.head_dim
    streams = cfg.hc_mult * cfg.hidden_size
    return 4 * (rows + streams + cfg.hidden_size + max(2 * rows, streams)) + e.columns * (e.row_bytes + ROW_INDEX_BYTES)


def segment_extra_bytes(cfg: ModelConfig) -> int:
    """Per segment token: its Engram rows at one Engram layer (the cache's floor), and their bytes
    as one gather hands them over with its index arrays (`DiskEngramRows.rows_chunks` reads a
    segment's rows at once, then dequantises them one sub-chunk at a time)."""
    if not cfg.engram:
        return 0
    e = cfg.engram
    return e.columns * (engram_slot_bytes(cfg) + e.row_bytes + ROW_INDEX_BYTES)
