"""The lightning indexer of ratio-4 layers: which compressed rows each query attends to.

Owns: the indexer's query, its score over the indexer's own compressed keys, and the
causal top-k. Its compressor (same windows as the main one, at index_head_dim) runs
through `compressor.compress`; this module only reads the rows it produced.

score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j]) / sqrt(index_head_dim), with
w = weights_proj(x) / sqrt(index_n_heads) and q = wq_b(q_residual), roped (compressed-layer
table) at the query position and not normalised. Rows j >= (t+1)//ratio are not yet
closed at position t and never chosen; ties go to the lower row index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...kernels import QWeight, index_scores, matmul
from ..ops import topk_lowest_index
from ..rope import apply_rope
from .compressor import CompressorWeights

F32 = np.float32


@dataclass(frozen=True)
class IndexerWeights:
    wq_b: QWeight  # (index_n_heads * index_head_dim, q_lora_rank)
    weights_proj: QWeight  # (index_n_heads, D)
    compressor: CompressorWeights  # at index_head_dim, with overlap


def select_rows(
    x: np.ndarray,
    q_residual: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    positions: np.ndarray,
    keys: np.ndarray,
    w: IndexerWeights,
    n_heads: int,
    topk: int,
    ratio: int,
    grid: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Rows each query may attend to: (T, K) row indices, -1 where fewer than K are valid.

    x (T, D) block input; q_residual (T, q_lora_rank); cos/sin (T, rd/2) at the query
    positions; keys (n, index_head_dim) the indexer's compressed rows so far.
    K = min(topk, n); each row's valid entries are in ascending order. grid, if given, rounds
    the roped queries as the keys were (V4's `official`: `kernels.actquant.index_grid_v4`).
    """
    t = x.shape[0]
    n = keys.shape[0]
    if n == 0:
        return np.zeros((t, 0), dtype=np.int64)
    q = matmul(w.wq_b, q_residual).reshape(t, n_heads, -1)
    q = apply_rope(q, cos, sin, in_place=True)
    if grid is not None:
        q = grid(q)
    hw = matmul(w.weights_proj, x) * F32(n_heads**-0.5)
    scores = index_scores(q, hw, keys)
    limit = (positions + 1) // ratio  # (T,) rows closed at each query
    valid = np.arange(n)[None, :] < limit[:, None]
    scores = np.where(valid, scores, -np.inf).astype(F32)
    k = min(topk, n)
    idx = topk_lowest_index(scores, k)
    ok = np.take_along_axis(valid, idx, axis=1)
    # push invalid picks (fewer than K closed rows) to the end, marked -1
    order = np.argsort(~ok, axis=1, kind="stable")
    idx = np.take_along_axis(np.where(ok, idx, -1), order, axis=1)
    return idx
