"""DeepSeek-V4.1 attention: a sliding window plus compressed rows shared between layers.

Owns: one layer's attention for a chunk of queries (q low-rank path, the window KV, the
shared compressed rows and the published row choice, attention with sink, de-rotation,
grouped output projection), which layer plays which part (`V41Plan`), and the state of a
layer (its window; at a KV source, the `SourceState`). The compressor and the index keys are
`model.v41.kv`; scores and top-k are `model.v41.indexer`.

Facts this follows (DeepSeek's V4.1 inference code), against V4 (`model.v4.attention`):
- q = wq_b(q_norm(wq_a x)) with no per-head RMS rescale; kv = kv_norm(wkv x); both rotated on
  the last rd channels (ratio 0: rope_theta; ratio > 0: compress_rope_theta with YaRN); the
  window KV is FP8-QDQ'd per 32 (official numerics) before it is cached or used.
- A layer with ratio > 0 reads the compressed rows of the latest KV source at or before it;
  only sources compress. It attends to the rows chosen by the latest index source at or
  before it (for this same chunk of queries): index sources choose, the others reuse.
- The output's rope channels are rotated back; wo_a (FP8 in the checkpoint) is applied per
  group as a plain dequantised product (no activation grid: DeepSeek's converter stores it as
  BF16); wo_b is an FP8 linear.
- Every FP8 linear's input goes through the activation grid (`model.v41.quant.act_qdq`) under the
  official numerics; the BF16 linears (weights_proj) do not.

Index keys, two ways (`V41Plan.stale_keys`): DeepSeek's code keeps one published key table;
a source publishes its keys only in a pass where it emits a row. So in a decode step where a
ratio-2 group is still open, layers 2, 8 and 14 score against the table the last emitting
source left (layer 20's, from the step before), cut to their own row count. "owner" (the
default) always scores against the layer's own KV source's keys, which is what a prefill
computes; "as-shipped" (stale_keys=True) reproduces the official decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import InternalError
from ...kernels import attend, matmul, matmul_grouped
from ..cache import WindowCache
from ..ops import fused, rms_norm
from ..projections import AttnProjections
from ..rope import Rope, apply_rope
from .indexer import (
    V41IndexerWeights,
    candidate_blocks,
    index_query,
    restrict_to,
    top_rows,
    visible_scores,
)
from .kv import IndexKeyWeights, SourceState, V41CompressorWeights, append_rows, latents
from .quant import act_qdq

F32 = np.float32


@dataclass(frozen=True)
class V41AttnWeights(AttnProjections):
    compressor: V41CompressorWeights | None  # KV sources
    keys: IndexKeyWeights | None  # KV sources that are index sources
    indexer: V41IndexerWeights | None  # index sources


@dataclass(frozen=True)
class V41Plan:
    """Which layer plays which part, and the attention's fixed numbers.

    kv_source[i] / index_source[i]: the layer whose compressed rows / row choice layer i uses
    (i itself for a source; -1 at window-only layers)."""

    ratios: tuple[int, ...]
    kv_source: tuple[int, ...]
    index_source: tuple[int, ...]
    candidate_source: int  # -1: no level one
    candidate_block: int
    candidate_topk_blocks: int
    n_heads: int
    head_dim: int
    window: int
    index_n_heads: int
    index_topk: int
    eps: float
    quantise: bool  # official numerics
    stale_keys: bool  # index keys as shipped

    @classmethod
    def build(
        cls,
        ratios: Sequence[int],
        kv_sources: Sequence[int],
        index_sources: Sequence[int],
        candidate_source: int,
        **fixed,
    ) -> V41Plan:
        """From the config's lists; InternalError where a compressed layer has no source before it
        (the config's validation refuses such a layer plan first)."""
        kv, ix = [], []
        for i, r in enumerate(ratios):
            if r == 0:
                kv.append(-1)
                ix.append(-1)
                continue
            ks = [s for s in kv_sources if s <= i]
            js = [s for s in index_sources if s <= i]
            if not ks or not js:
                raise InternalError(f"layer {i} (ratio {r}) has no KV source or index source at or before it")
            kv.append(max(ks))
            ix.append(max(js))
        return cls(tuple(ratios), tuple(kv), tuple(ix), candidate_source, **fixed)


@dataclass
class V41LayerState:
    window: WindowCache
    source: SourceState | None  # at KV sources


@dataclass
class KeyBoard:
    """Session state for index keys as shipped: the KV source that published its keys last."""

    publisher: int = -1


@dataclass
class Published:
    """What the layers of one forward pass hand down for one chunk of queries."""

    rows: np.ndarray | None = None  # (T, K) the latest index source's choice, -1 = none
    blocks: np.ndarray | None = None  # (T, nb) the candidate source's kept blocks


def new_layer_state(plan: V41Plan, layer: int, index_head_dim: int) -> V41LayerState:
    src = None
    if plan.kv_source[layer] == layer:  # keyed: a KV source that is also an index source (its key weights)
        src = SourceState(plan.head_dim, index_head_dim, plan.ratios[layer], plan.index_source[layer] == layer)
    return V41LayerState(WindowCache(plan.window, plan.head_dim), src)


def _aq(x: np.ndarray, plan: V41Plan) -> np.ndarray:
    return act_qdq(x) if plan.quantise else x


def _compress(
    x: np.ndarray,
    w: V41AttnWeights,
    layer: int,
    states: Sequence[V41LayerState],
    plan: V41Plan,
    board: KeyBoard,
    rope: Rope,
) -> SourceState:
    """This chunk's compression at a KV source (rows, keys, `board`): the state part, from every
    row of x; returns the layer's KV source."""
    src = states[plan.kv_source[layer]].source
    if src is None:
        raise InternalError(f"layer {layer} reads KV source {plan.kv_source[layer]}, which holds no rows")
    if w.compressor is not None:
        lat = latents(src, x, w.compressor, plan.eps)
        append_rows(src, lat, plan.ratios[layer], rope, w.keys, plan.eps, plan.quantise)
        if lat.shape[0] and w.keys is not None:
            board.publisher = layer
    return src


def _chosen(
    x: np.ndarray,
    qr: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    w: V41AttnWeights,
    layer: int,
    src: SourceState,
    states: Sequence[V41LayerState],
    plan: V41Plan,
    pub: Published,
    board: KeyBoard,
) -> np.ndarray:
    """The rows (T, K) these queries attend to: chosen here at an index source (and published in
    `pub` for the layers after it), else the choice published for the same queries (the last T
    of the sub-chunk's: a pass cut to its last rows reads theirs)."""
    ratio, t = plan.ratios[layer], x.shape[0]
    if w.indexer is not None:
        end = int(positions[-1]) + 1
        visible = end // ratio
        if visible == 0:
            pub.rows = np.zeros((t, 0), dtype=np.int64)
        else:
            keys = _index_keys(src, states, plan, board)[:visible]
            q, hw = index_query(qr, x, cos, sin, w.indexer, plan.index_n_heads, plan.quantise)
            scores = visible_scores(q, hw, keys, positions, ratio)
            if layer == plan.candidate_source:
                pub.blocks = candidate_blocks(
                    scores, positions, ratio, plan.candidate_block, plan.candidate_topk_blocks
                )
            elif 0 <= plan.candidate_source < layer:
                if pub.blocks is None:
                    raise InternalError(f"layer {layer}: no candidate blocks from layer {plan.candidate_source}")
                scores = restrict_to(scores, pub.blocks[pub.blocks.shape[0] - t :], plan.candidate_block)
            pub.rows = top_rows(scores, end, ratio, plan.index_topk)
    if pub.rows is None:
        raise InternalError(f"layer {layer}: no row choice from index source {plan.index_source[layer]}")
    return pub.rows[pub.rows.shape[0] - t :]


def _index_keys(src: SourceState, states: Sequence[V41LayerState], plan: V41Plan, board: KeyBoard) -> np.ndarray:
    """The key table an index source scores against: its KV source's, or as shipped, the table of
    the source that published last (this layer, if it just emitted; see the module docstring)."""
    if plan.stale_keys and board.publisher >= 0:
        held = states[board.publisher].source
        if held is not None:
            return held.keys.rows
    return src.keys.rows


def attention(
    x: np.ndarray,
    positions: np.ndarray,
    w: V41AttnWeights,
    layer: int,
    states: Sequence[V41LayerState],
    plan: V41Plan,
    pub: Published,
    board: KeyBoard,
    rope: Rope,
    out_from: int = 0,
) -> np.ndarray:
    """One layer's attention for a chunk: x (T, D) normed block input at positions (T,) -> (T - out_from, D).

    Updates the layer's window, its KV source's rows and keys (at a source), `pub` (at an index
    source) and `board` (a source that published keys). out_from: the first row whose output is
    wanted; every row updates the state (it comes from x alone), the query path runs for rows
    out_from: only (the last layer of a pass that wants only the last position's logits; each
    kernel's row has the same bits whatever the other rows of its call)."""
    cos, sin = rope.cos_sin(positions)
    xq = _aq(x, plan)
    kv = project_kv(xq, cos, sin, w, plan)
    if out_from >= x.shape[0]:  # no row wanted: the state only
        attend_state(x, None, None, kv, positions, cos, sin, w, layer, states, plan, pub, board, rope, out_from)
        return np.zeros((0, x.shape[1]), dtype=F32)
    qrq, q = project_q(xq[out_from:], cos[out_from:], sin[out_from:], w, plan)
    o = attend_state(x, qrq, q, kv, positions, cos, sin, w, layer, states, plan, pub, board, rope, out_from)
    return project_out(o, cos[out_from:], sin[out_from:], w, plan)


def attention_rows(
    x: np.ndarray,
    positions: np.ndarray,
    w: V41AttnWeights,
    layer: int,
    rows: Sequence[tuple[Sequence[V41LayerState], Published, KeyBoard]],
    plan: V41Plan,
    rope: Rope,
) -> np.ndarray:
    """One decode token of each of B sequences: x (B, D) at positions (B,), row b's states,
    published choice and key board in rows[b] -> (B, D), row b bit for bit `attention` of that
    row alone. The projections (wq_a, wq_b, wkv; wo_a, wo_b) run once over the B rows; what reads
    and updates a sequence's state, row by row (as V4's `model.v4.attention.attention_rows`)."""
    tables = [rope.cos_sin(positions[b : b + 1]) for b in range(x.shape[0])]  # each row's own table rows
    cos, sin = np.concatenate([c for c, _ in tables]), np.concatenate([s for _, s in tables])
    xq = _aq(x, plan)
    qrq, q = project_q(xq, cos, sin, w, plan)
    kv = project_kv(xq, cos, sin, w, plan)
    o = np.empty_like(q)
    for b, (states, pub, board) in enumerate(rows):
        r = slice(b, b + 1)
        o[r] = attend_state(
            x[r], qrq[r], q[r], kv[r], positions[r], cos[r], sin[r], w, layer, states, plan, pub, board, rope
        )
    return project_out(o, cos, sin, w, plan)


def project_q(
    xq: np.ndarray, cos: np.ndarray, sin: np.ndarray, w: V41AttnWeights, plan: V41Plan
) -> tuple[np.ndarray, np.ndarray]:
    """The query projections of xq (T, D), x on the activation grid where the plan quantises:
    the low-rank row (on the grid too) and q (T, H, hd) roped."""
    t = xq.shape[0]
    qr = rms_norm(matmul(w.wq_a, xq), w.q_norm, plan.eps)
    qrq = _aq(qr, plan)
    return qrq, apply_rope(matmul(w.wq_b, qrq).reshape(t, plan.n_heads, plan.head_dim), cos, sin, in_place=True)


def project_kv(xq: np.ndarray, cos: np.ndarray, sin: np.ndarray, w: V41AttnWeights, plan: V41Plan) -> np.ndarray:
    """The window key/value of xq (T, D): kv (T, hd) normed, roped and on the grid."""
    kv = apply_rope(rms_norm(matmul(w.wkv, xq), w.kv_norm, plan.eps), cos, sin, in_place=True)
    return _aq(kv, plan)


def attend_state(
    x: np.ndarray,
    qrq: np.ndarray | None,
    q: np.ndarray | None,
    kv: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    w: V41AttnWeights,
    layer: int,
    states: Sequence[V41LayerState],
    plan: V41Plan,
    pub: Published,
    board: KeyBoard,
    rope: Rope,
    out_from: int = 0,
) -> np.ndarray | None:
    """The part that reads and updates one sequence's state: the window and the KV source's rows
    from all T rows, then for the rows out_from: (whose qrq, q are given: None when no row is
    wanted) the index choice and the scores -> o (T - out_from, H, hd), still roped."""
    st = states[layer]
    # `ordered`: keys in a reused buffer, read by `attend` below before any other call (`fused`: the
    # switch bench/trunk_overhead.py turns off to time the numpy steps)
    keys, kpos = (st.window.ordered if fused() else st.window.with_new)(kv, positions)
    dist = positions[:, None] - kpos[None, :]
    key_mask = (dist >= 0) & (dist < plan.window)
    st.window.push(kv, positions)
    src = _compress(x, w, layer, states, plan, board, rope) if plan.ratios[layer] else None
    if q is None:  # the state is whole and no row's output is wanted
        return None
    if out_from:  # the state is whole: the rest is the wanted rows' queries
        x, positions, cos, sin = x[out_from:], positions[out_from:], cos[out_from:], sin[out_from:]
        key_mask = key_mask[out_from:]

    comp = comp_idx = None
    if src is not None:
        comp, comp_idx = src.rows.rows, _chosen(x, qrq, positions, cos, sin, w, layer, src, states, plan, pub, board)
        if comp_idx.shape[1] == 0:
            comp = comp_idx = None
    return attend(q, keys, key_mask, comp, None, comp_idx, w.sink)


def project_out(o: np.ndarray, cos: np.ndarray, sin: np.ndarray, w: V41AttnWeights, plan: V41Plan) -> np.ndarray:
    """o (T, H, hd) -> (T, D): the rope channels rotated back, the grouped wo_a, then wo_b."""
    o = apply_rope(o, cos, sin, inverse=True, in_place=True)
    mid = matmul_grouped(w.wo_a, o.reshape(o.shape[0], len(w.wo_a), -1))  # (T, g * o_lora_rank)
    return matmul(w.wo_b, _aq(mid, plan))
