"""V4 attention: one shared KV head over a sliding window plus compressed rows.

Owns: the attention block of one layer (q low-rank path, the shared key/value vector, the
window cache, attention with sink, de-rotation, grouped output projection) and its
per-sequence state. Compressed rows come from `compressor`; at ratio 4 the rows a query
sees are chosen by `indexer`, at other ratios it sees every closed row.

Facts this follows: q = wq_b(q_norm(wq_a x)) is RMS-normalised per head without weight;
kv = kv_norm(wkv x) is both key and value; both are roped on the trailing qk_rope_head_dim
channels (window-only layers: rope_theta table; compressed layers: the YaRN table); scores
are scaled by head_dim^-0.5; the per-head sink joins the softmax denominator only; the
output's rope channels are rotated back by the query's angle; heads are split into
o_groups groups, each projected by its own slice of wo_a, then mixed by wo_b.

Shapes: T queries of the chunk, H heads, hd head_dim, D hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..checkpoint.config import ModelConfig
from ..kernels import QWeight, matmul, matmul_grouped
from .compressor import CompressorState, CompressorWeights, compress
from .indexer import IndexerWeights, select_rows
from .ops import rms_norm
from .rope import Rope, apply_rope

F32 = np.float32
GATHER_FLOATS = 4 << 20  # compressed rows gathered per block of queries (planner.BLOCK_FLOATS)
# Below this many multiply-adds `attend` runs numpy's BLAS on one thread (`attend_macs`). OpenBLAS
# threads a product from a few hundred thousand; on 2 AMD EPYC cores with one busy (load 1.6-2.2,
# `attend`, 64 queries, 7 runs) 4 heads x 128 over 192 keys + 64 rows (16.8 M) took 11.9 ms on
# two threads and 0.64 ms on one. The second thread waits for a core numba's workers or another
# program hold, and spins after the call against the kernels that follow. One thread costs at
# most the split, under a millisecond at this size; V4-Flash's 64 x 512 (2.95 G) keeps its threads.
ONE_THREAD_MACS = 1 << 25


@dataclass(frozen=True)
class AttnWeights:
    wq_a: QWeight  # (q_lora_rank, D)
    q_norm: np.ndarray  # (q_lora_rank,)
    wq_b: QWeight  # (H * hd, q_lora_rank)
    wkv: QWeight  # (hd, D)
    kv_norm: np.ndarray  # (hd,)
    wo_a: tuple[QWeight, ...]  # o_groups x (o_lora_rank, H * hd / o_groups)
    wo_b: QWeight  # (D, o_groups * o_lora_rank)
    sink: np.ndarray  # (H,)
    ratio: int  # 0 window-only, 4 with indexer, else heavily compressed
    compressor: CompressorWeights | None
    indexer: IndexerWeights | None


class WindowCache:
    """The last `size` (key=value) rows with their positions; a ring, never the full history."""

    def __init__(self, size: int, d: int) -> None:
        self.kv = np.zeros((size, d), dtype=F32)
        self.pos = np.full(size, -1, dtype=np.int64)

    def with_new(self, kv: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Cached rows followed by the chunk's rows: keys (S, d), positions (S,)."""
        held = self.pos >= 0
        return np.concatenate([self.kv[held], kv]), np.concatenate([self.pos[held], positions])

    def push(self, kv: np.ndarray, positions: np.ndarray) -> None:
        size = self.pos.shape[0]
        kv, positions = kv[-size:], positions[-size:]
        slots = positions % size
        self.kv[slots] = kv
        self.pos[slots] = positions


@dataclass
class AttnState:
    window: WindowCache
    comp: CompressorState | None
    index_comp: CompressorState | None


def new_attn_state(cfg: ModelConfig, ratio: int) -> AttnState:
    hd = cfg.head_dim
    comp = CompressorState(hd, overlap=ratio == 4) if ratio else None
    index_comp = CompressorState(cfg.index_head_dim, overlap=True) if ratio == 4 else None
    return AttnState(WindowCache(cfg.sliding_window, hd), comp, index_comp)


def attend_macs(cfg: ModelConfig, ratio: int, queries: int, end: int) -> int:
    """Multiply-adds of `attend` (scores and weighted sum) for `queries` queries ending at
    position `end` (exclusive): the window and the chunk's keys, plus index_topk rows at ratio 4
    or every closed row at other ratios."""
    rows = cfg.sliding_window + queries
    if ratio == 4:
        rows += cfg.index_topk
    elif ratio:
        rows += end // ratio
    return 2 * queries * cfg.num_attention_heads * cfg.head_dim * rows


def attend(
    q: np.ndarray,
    keys: np.ndarray,
    key_mask: np.ndarray,
    comp: np.ndarray | None,
    comp_mask: np.ndarray | None,
    comp_idx: np.ndarray | None,
    sink: np.ndarray,
) -> np.ndarray:
    """Softmax attention with a sink; one KV vector is both key and value.

    q (T, H, hd); keys (S, hd) with key_mask (T, S) True = visible; compressed rows comp
    (n, hd) seen either densely through comp_mask (T, n) or per query through comp_idx
    (T, K) (-1 = none); sink (H,). Returns (T, H, hd).
    """
    t, h, hd = q.shape
    if comp is not None and comp_idx is not None and t > 1 and t * comp_idx.shape[1] * hd > GATHER_FLOATS:
        # queries are independent: gather each block's rows alone, so the (T, K, hd) copy
        # stays near GATHER_FLOATS (64 queries x 512 rows x 512 would be 64 MiB)
        step = max(1, GATHER_FLOATS // max(1, comp_idx.shape[1] * hd))
        return np.concatenate(
            [
                attend(q[a : a + step], keys, key_mask[a : a + step], comp, None, comp_idx[a : a + step], sink)
                for a in range(0, t, step)
            ]
        )
    scale = F32(hd**-0.5)
    qf = q.reshape(t * h, hd)
    parts = [np.where(key_mask[:, None, :], (qf @ keys.T).reshape(t, h, -1) * scale, -np.inf)]
    gathered = None
    if comp is not None and comp_mask is not None:
        parts.append(np.where(comp_mask[:, None, :], (qf @ comp.T).reshape(t, h, -1) * scale, -np.inf))
    elif comp is not None and comp_idx is not None and comp_idx.shape[1]:
        gathered = comp[np.maximum(comp_idx, 0)]  # (T, K, hd)
        sc = np.matmul(q, gathered.transpose(0, 2, 1)) * scale
        parts.append(np.where(comp_idx[:, None, :] >= 0, sc, -np.inf))
    parts.append(np.broadcast_to(sink[None, :, None], (t, h, 1)))
    logits = np.concatenate(parts, axis=-1).astype(F32, copy=False)
    m = np.max(logits, axis=-1, keepdims=True)
    e = np.exp(logits - m)
    p = e / np.sum(e, axis=-1, keepdims=True)
    s = keys.shape[0]
    out = (p[:, :, :s].reshape(t * h, s) @ keys).reshape(t, h, hd)
    if comp is not None and comp_mask is not None:
        n = comp.shape[0]
        out += (p[:, :, s : s + n].reshape(t * h, n) @ comp).reshape(t, h, hd)
    elif gathered is not None:
        k = gathered.shape[1]
        out += np.matmul(p[:, :, s : s + k], gathered)
    return out


def attention(
    x: np.ndarray,
    positions: np.ndarray,
    w: AttnWeights,
    st: AttnState,
    cfg: ModelConfig,
    rope: Rope,
    on_index: Callable[[np.ndarray], None] | None = None,
) -> np.ndarray:
    """One layer's attention for a chunk: x (T, D) normed block input at positions (T,) -> (T, D).

    on_index, if given, sees the indexer's choice (T, K) at ratio-4 layers.
    """
    t = x.shape[0]
    h, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    cos, sin = rope.cos_sin(positions)

    q_res = rms_norm(matmul(w.wq_a, x), w.q_norm, eps)
    q = rms_norm(matmul(w.wq_b, q_res).reshape(t, h, hd), None, eps)
    q = apply_rope(q, cos, sin, in_place=True)
    kv = apply_rope(rms_norm(matmul(w.wkv, x), w.kv_norm, eps), cos, sin, in_place=True)

    # held rows then the chunk's, for a step too: the same keys in the same order whatever the
    # chunking, so a state restored mid-prompt (the server's prefix cache) gives the same bits
    keys, kpos = st.window.with_new(kv, positions)
    dist = positions[:, None] - kpos[None, :]
    key_mask = (dist >= 0) & (dist < cfg.sliding_window)
    st.window.push(kv, positions)

    comp = comp_mask = comp_idx = None
    if w.ratio:
        compress(st.comp, x, w.compressor, rope, eps)
        comp = st.comp.rows
        closed = (positions + 1) // w.ratio  # rows a query at each position may use
        if w.indexer is None:
            comp_mask = np.arange(comp.shape[0])[None, :] < closed[:, None]
        else:
            compress(st.index_comp, x, w.indexer.compressor, rope, eps)
            comp_idx = select_rows(
                x,
                q_res,
                cos,
                sin,
                positions,
                st.index_comp.rows,
                w.indexer,
                cfg.index_n_heads,
                cfg.index_topk,
                w.ratio,
            )
            if on_index is not None:
                on_index(comp_idx)

    o = attend(q, keys, key_mask, comp, comp_mask, comp_idx, w.sink)
    o = apply_rope(o, cos, sin, inverse=True, in_place=True)

    mid = matmul_grouped(w.wo_a, o.reshape(t, len(w.wo_a), -1))  # (T, g * o_lora_rank)
    return matmul(w.wo_b, mid)
