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

from ...checkpoint.config import CSA, WINDOW, ModelConfig
from ...kernels import attend, get_numerics, matmul, matmul_grouped
from ...kernels.actquant import index_grid_v4, kv_grid_v4
from ..cache import WindowCache
from ..ops import fused, rms_norm
from ..projections import AttnProjections
from ..rope import Rope, apply_rope
from .compressor import CompressorState, CompressorWeights, compress
from .indexer import IndexerWeights, select_rows

F32 = np.float32


@dataclass(frozen=True)
class AttnWeights(AttnProjections):
    ratio: int  # 0 window-only, 4 with indexer, else heavily compressed
    compressor: CompressorWeights | None
    indexer: IndexerWeights | None


@dataclass
class AttnState:
    window: WindowCache
    comp: CompressorState | None
    index_comp: CompressorState | None


def new_attn_state(cfg: ModelConfig, layer: int) -> AttnState:
    """Layer `layer`'s empty state: its window, and the compressors its kind has (CSA: the main
    one with overlapping windows and the indexer's; HCA: the main one)."""
    hd, kind, ratio = cfg.head_dim, cfg.layer_kind(layer), cfg.ratio(layer)
    comp = CompressorState(hd, overlap=kind == CSA, ratio=ratio) if kind != WINDOW else None
    index_comp = CompressorState(cfg.index_head_dim, overlap=True, ratio=ratio) if kind == CSA else None
    return AttnState(WindowCache(cfg.sliding_window, hd), comp, index_comp)


def attention(
    x: np.ndarray,
    positions: np.ndarray,
    w: AttnWeights,
    st: AttnState,
    cfg: ModelConfig,
    rope: Rope,
    on_index: Callable[[np.ndarray], None] | None = None,
    out_from: int = 0,
) -> np.ndarray:
    """One layer's attention for a chunk: x (T, D) normed block input at positions (T,) -> (T - out_from, D).

    out_from: the first row whose output is wanted. Every row updates the state (window,
    compressors: they come from x alone); the query path (q, indexer choice, attend, output
    projections) runs only for rows out_from: (the last layer of a pass that wants only the last
    position's logits). Each kernel's row is the same bits whatever the other rows of the call,
    so those rows equal a full call's. on_index, if given, sees the indexer's choice (T', K) at
    ratio-4 layers.
    """
    cos, sin = rope.cos_sin(positions)
    kv = project_kv(x, cos, sin, w, cfg)
    if out_from >= x.shape[0]:  # no row wanted: the state only
        attend_state(x, None, None, kv, positions, cos, sin, w, st, cfg, rope, on_index, out_from)
        return np.zeros((0, cfg.hidden_size), dtype=F32)
    q_res, q = project_q(x[out_from:], cos[out_from:], sin[out_from:], w, cfg)
    o = attend_state(x, q_res, q, kv, positions, cos, sin, w, st, cfg, rope, on_index, out_from)
    return project_out(o, cos[out_from:], sin[out_from:], w)


def attention_rows(
    x: np.ndarray, positions: np.ndarray, w: AttnWeights, states: list[AttnState], cfg: ModelConfig, rope: Rope
) -> np.ndarray:
    """One decode token of each of B sequences: x (B, D) at positions (B,), row b in states[b]
    -> (B, D), row b bit for bit `attention(x[b:b+1], positions[b:b+1], w, states[b], ...)`.

    The projections (wq_a, wq_b, wkv; wo_a, wo_b) are products of each row with the same weights:
    one kernel call for the B rows (the kernels give a row the bits of its one-row product, and
    the norms and rope are row by row); only what reads and updates a sequence's state (the
    window, the compressors, the indexer, the scores) runs row by row."""
    rows = [rope.cos_sin(positions[b : b + 1]) for b in range(x.shape[0])]  # each row's own table rows
    cos, sin = np.concatenate([c for c, _ in rows]), np.concatenate([s for _, s in rows])
    q_res, q = project_q(x, cos, sin, w, cfg)
    kv = project_kv(x, cos, sin, w, cfg)
    o = np.empty_like(q)
    for b, st in enumerate(states):
        r = slice(b, b + 1)
        o[r] = attend_state(x[r], q_res[r], q[r], kv[r], positions[r], cos[r], sin[r], w, st, cfg, rope)
    return project_out(o, cos, sin, w)


def project_q(
    x: np.ndarray, cos: np.ndarray, sin: np.ndarray, w: AttnWeights, cfg: ModelConfig
) -> tuple[np.ndarray, np.ndarray]:
    """The query projections of x (T, D): q_res (T, q_lora_rank), q (T, H, hd) normed and roped."""
    t = x.shape[0]
    h, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    q_res = rms_norm(matmul(w.wq_a, x), w.q_norm, eps)
    q = rms_norm(matmul(w.wq_b, q_res).reshape(t, h, hd), None, eps)
    return q_res, apply_rope(q, cos, sin, in_place=True)


def project_kv(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, w: AttnWeights, cfg: ModelConfig) -> np.ndarray:
    """The window key/value of x (T, D): kv (T, hd) normed and roped, on `official`'s KV grid
    when it is in force."""
    kv = apply_rope(rms_norm(matmul(w.wkv, x), w.kv_norm, cfg.rms_norm_eps), cos, sin, in_place=True)
    # `official`: what V4's reference keeps is rounded as it rounds it (kernels/actquant.py):
    # the window KV and the compressed rows on E4M3 (RoPE channels kept), the indexer on FP4
    if get_numerics() == "official":
        kv = kv_grid_v4(kv, cfg.qk_rope_head_dim)
    return kv


def attend_state(
    x: np.ndarray,
    q_res: np.ndarray | None,
    q: np.ndarray | None,
    kv: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    w: AttnWeights,
    st: AttnState,
    cfg: ModelConfig,
    rope: Rope,
    on_index: Callable[[np.ndarray], None] | None = None,
    out_from: int = 0,
) -> np.ndarray | None:
    """The part that reads and updates one sequence's state: the window and the compressed rows
    from all T rows of x / kv, then for the rows out_from: (whose q_res, q are given: None when
    no row is wanted) the indexer's choice at ratio 4 and the scores -> o (T - out_from, H, hd),
    still roped."""
    eps, rd = cfg.rms_norm_eps, cfg.qk_rope_head_dim
    official = get_numerics() == "official"
    # held rows then the chunk's, for a step too: the same keys in the same order whatever the
    # chunking, so a state restored mid-prompt (the server's prefix cache) gives the same bits
    # `ordered`: keys in a reused buffer, read by `attend` below before any other call (`fused`: the
    # switch bench/trunk_overhead.py turns off to time the numpy steps)
    keys, kpos = (st.window.ordered if fused() else st.window.with_new)(kv, positions)
    dist = positions[:, None] - kpos[None, :]
    key_mask = (dist >= 0) & (dist < cfg.sliding_window)
    st.window.push(kv, positions)

    index_grid = index_grid_v4 if official else None
    if w.ratio:
        compress(st.comp, x, w.compressor, rope, eps, (lambda r: kv_grid_v4(r, rd)) if official else None)
        if w.indexer is not None:
            compress(st.index_comp, x, w.indexer.compressor, rope, eps, index_grid)
    if q is None:  # the state is whole and no row's output is wanted
        return None
    if out_from:  # the state is whole: the rest is the wanted rows' queries
        x, positions, cos, sin = x[out_from:], positions[out_from:], cos[out_from:], sin[out_from:]
        key_mask = key_mask[out_from:]

    comp = comp_mask = comp_idx = None
    if w.ratio:
        comp = st.comp.rows
        closed = (positions + 1) // w.ratio  # rows a query at each position may use
        if w.indexer is None:
            comp_mask = np.arange(comp.shape[0])[None, :] < closed[:, None]
        else:
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
                index_grid,
            )
            if on_index is not None:
                on_index(comp_idx)

    return attend(q, keys, key_mask, comp, comp_mask, comp_idx, w.sink)


def project_out(o: np.ndarray, cos: np.ndarray, sin: np.ndarray, w: AttnWeights) -> np.ndarray:
    """o (T, H, hd) -> (T, D): the rope channels rotated back, the grouped wo_a, then wo_b."""
    o = apply_rope(o, cos, sin, inverse=True, in_place=True)
    mid = matmul_grouped(w.wo_a, o.reshape(o.shape[0], len(w.wo_a), -1))  # (T, g * o_lora_rank)
    return matmul(w.wo_b, mid)
