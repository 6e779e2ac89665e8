"""DeepSeek-V4.1's indexer: which compressed rows each query attends to, in two levels.

Owns: the index scores of an index-source layer against its KV source's index keys, the
candidate blocks of the candidate source (level one) and the top-k inside them (level two).
Layers that are not index sources reuse the last source's choice (`model.v41.attention`).

Facts this follows (DeepSeek's V4.1 inference code):
- q = wq_b(q_residual) per index head, its last rd channels rotated at the query position
  (the layer's own table), then (official numerics) FP4-QDQ per 32 with E8M0 scales;
  w = weights_proj(x) / sqrt(index_head_dim * index_n_heads);
  score[t, j] = sum_h relu(q[t, h] . k[j]) * w[t, h]; rows j >= (p_t + 1) // ratio are not
  visible to the query at position p_t and score -inf.
- Level one, at the candidate source: rows form blocks of `block` consecutive rows, a block
  scores the max of its rows, the block holding the query's newest visible row is always
  kept, and the `topk_blocks` best blocks (those with a finite score) are the candidates.
- Level two, at index sources after the candidate source: rows outside the candidates score
  -inf. The candidate source itself chooses among all visible rows.
- Each query keeps its top min(index_topk, visible at the chunk's end) rows; a choice whose
  score is -inf is no row (-1). Ties go to the lower row index here (DeepSeek's top-k leaves
  their order to the implementation), so the choice never depends on thread count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...kernels import QWeight, index_scores, matmul
from ..ops import topk_lowest_index
from ..rope import apply_rope
from .quant import fp4_qdq_e8m0

F32 = np.float32


@dataclass(frozen=True)
class V41IndexerWeights:
    wq_b: QWeight  # (index_n_heads * index_head_dim, q_lora_rank)
    weights_proj: QWeight  # (index_n_heads, D)


def index_query(
    qr: np.ndarray, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, w: V41IndexerWeights, n_heads: int, quantise: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(q (T, h, c), head weights (T, h)) of queries with q_residual qr (T, q_lora) and block input
    x (T, D); qr has been through the activation grid already where the numerics ask for it."""
    t = x.shape[0]
    q = apply_rope(matmul(w.wq_b, qr).reshape(t, n_heads, -1), cos, sin, in_place=True)
    if quantise:
        q = fp4_qdq_e8m0(q, 32)
    hw = matmul(w.weights_proj, x) * F32(n_heads**-0.5)  # index_scores applies 1/sqrt(c)
    return q, hw


def visible_scores(q: np.ndarray, hw: np.ndarray, keys: np.ndarray, positions: np.ndarray, ratio: int) -> np.ndarray:
    """Scores (T, n) of queries at positions (T,) against keys (n, c); invisible rows -inf."""
    scores = index_scores(q, hw, keys)
    visible = np.arange(keys.shape[0])[None, :] < ((positions + 1) // ratio)[:, None]
    return np.where(visible, scores, -np.inf).astype(F32)


def candidate_blocks(scores: np.ndarray, positions: np.ndarray, ratio: int, block: int, topk_blocks: int) -> np.ndarray:
    """Level one: scores (T, n) with invisible rows at -inf -> kept blocks (T, ceil(n / block)) bool."""
    t, n = scores.shape
    nb = -(-n // block)
    padded = np.full((t, nb * block), -np.inf, dtype=F32)
    padded[:, :n] = scores
    bs = padded.reshape(t, nb, block).max(axis=2)
    newest = ((positions + 1) // ratio - 1) // block  # -1 (none visible) pins nothing
    bs[np.arange(nb)[None, :] == newest[:, None]] = np.inf
    k = min(topk_blocks, nb)
    if k == 0:
        return np.zeros((t, nb), dtype=bool)
    top = topk_lowest_index(bs, k)
    keep = np.zeros((t, nb), dtype=bool)
    np.put_along_axis(keep, top, np.take_along_axis(bs, top, axis=1) > -np.inf, axis=1)
    return keep


def restrict_to(scores: np.ndarray, blocks: np.ndarray, block: int) -> np.ndarray:
    """Level two: rows outside the kept blocks (T, nb) score -inf."""
    rows = np.repeat(blocks, block, axis=1)[:, : scores.shape[1]]
    return np.where(rows, scores, -np.inf).astype(F32)


def top_rows(scores: np.ndarray, positions_end: int, ratio: int, topk: int) -> np.ndarray:
    """(T, n) scores -> (T, K) chosen rows, K = min(topk, visible at the chunk's end); rows the
    query cannot use (score -inf) are -1, after the real ones (which are in ascending order)."""
    t, n = scores.shape
    k = min(topk, positions_end // ratio, n)
    if k <= 0:
        return np.zeros((t, 0), dtype=np.int64)
    idx = topk_lowest_index(scores, k)
    ok = np.take_along_axis(scores, idx, axis=1) > -np.inf
    order = np.argsort(~ok, axis=1, kind="stable")
    return np.take_along_axis(np.where(ok, idx, -1), order, axis=1)
