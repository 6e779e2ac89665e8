"""One DeepSeek-V4.1 block and the head, on the hc_mult residual streams.

Owns: the order of operations inside a V4.1 layer and the head, with hyper-connections
computed one sublayer ahead. Weights, state and the published row choice come in; nothing
is looked up by name. As in V4 (`model.v4.block`), the two halves are separate calls so that a
prefill segment can run attention in sub-chunks and the MoE over the whole segment.

Facts this follows (DeepSeek's V4.1 `Block.forward`), against V4:
- a sublayer's `hc_mixes(streams)` gives (pre, post, comb); post and comb fold that sublayer's
  own output back, but its pre collapses the streams for the *next* sublayer: attention uses
  the pre the previous layer's FFN half produced, the FFN uses the pre its attention half
  produced. Before layer 0 the pre is one-hot on stream 0.
- mixes = (fn @ streams_flat) * rsqrt(mean(streams_flat^2) + eps) (the flat vector normed after
  the product), then the same split and Sinkhorn as V4 (`model.mhc.split_mixes`).
- the head collapses the streams with the last FFN half's pre (no hc_head), RMS-norms and
  multiplies by head.weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...kernels import QWeight, matmul
from ...kernels.head import head_logits
from ..mhc import HcWeights, collapse, hc_post, split_mixes
from ..moe import ExpertSource
from ..ops import fused
from ..rope import Rope
from .attention import KeyBoard, Published, V41AttnWeights, V41LayerState, V41Plan, attention, attention_rows
from .engram import EngramWeights
from .moe import V41MoeParams, V41MoeWeights, moe

F32 = np.float32


@dataclass(frozen=True)
class V41LayerWeights:
    index: int
    attn_norm: np.ndarray  # (D,)
    ffn_norm: np.ndarray  # (D,)
    hc_attn: HcWeights
    hc_ffn: HcWeights
    attn: V41AttnWeights
    moe: V41MoeWeights
    engram: EngramWeights | None  # layers listed in engram_layer_ids


@dataclass(frozen=True)
class V41HeadWeights:
    norm: np.ndarray  # (D,)
    head: QWeight  # (vocab, D)
    q8: object | None = None  # the pack's int8 copy of head (`kernels.headq8.Int8Head`): fast's logits


@dataclass(frozen=True)
class HcParams:
    sinkhorn_iters: int
    hc_eps: float
    norm_eps: float


def identity_pre(t: int, hc: int) -> np.ndarray:
    """The pre before layer 0: (T, hc), one-hot on stream 0."""
    pre = np.zeros((t, hc), dtype=F32)
    pre[:, 0] = 1.0
    return pre


def hc_mixes(x: np.ndarray, w: HcWeights, p: HcParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Streams x (T, hc, D) -> (pre (T, hc), post (T, hc), comb (T, hc, hc))."""
    flat = x.reshape(x.shape[0], -1)
    r = inv_rms(flat, p.norm_eps)
    return split_mixes(matmul(w.fn, flat) * r, w, p.sinkhorn_iters, p.hc_eps)


def inv_rms(flat: np.ndarray, eps: float) -> np.ndarray:
    """(T, N) -> (T, 1): 1 / sqrt(mean(flat^2) + eps), in one numba call under the fast backend."""
    if fused(flat) and flat.size:
        from ...kernels import trunkops

        return trunkops.inv_rms(flat, eps)
    return inv_rms_numpy(flat, eps)


def inv_rms_numpy(flat: np.ndarray, eps: float) -> np.ndarray:
    """`inv_rms` in numpy: the definition `kernels.trunkops.inv_rms` follows bit for bit."""
    return F32(1.0) / np.sqrt(np.mean(np.square(flat), axis=-1, keepdims=True, dtype=F32) + F32(eps))


def attention_half(
    x: np.ndarray,
    pre: np.ndarray,
    positions: np.ndarray,
    w: V41LayerWeights,
    states: list[V41LayerState],
    plan: V41Plan,
    pub: Published,
    board: KeyBoard,
    rope: Rope,
    hp: HcParams,
    out_from: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Streams x (T, hc, D) and the pre they arrive with -> (streams after attention, the FFN's pre)
    of rows out_from: (every row updates the state: `attention`'s out_from)."""
    h = collapse(x, pre, w.attn_norm, hp.norm_eps)
    y = attention(h, positions, w.attn, w.index, states, plan, pub, board, rope, out_from)
    x = x[out_from:]
    if x.shape[0] == 0:  # the state alone was wanted
        return x, np.zeros((0, pre.shape[1]), dtype=F32)
    a_pre, post, comb = hc_mixes(x, w.hc_attn, hp)
    return hc_post(x, y, post, comb), a_pre


def attention_half_rows(
    x: np.ndarray,
    pre: np.ndarray,
    positions: np.ndarray,
    w: V41LayerWeights,
    rows: list[tuple[list[V41LayerState], Published, KeyBoard]],
    plan: V41Plan,
    rope: Rope,
    hp: HcParams,
) -> tuple[np.ndarray, np.ndarray]:
    """One decode token of each of B sequences (row b's states, published choice and key board in
    rows[b]) -> (streams after attention, the FFN's pre), row b bit for bit `attention_half` of
    that row alone: the mixes, the norm and the attention's projections once over the B rows."""
    a_pre, post, comb = hc_mixes(x, w.hc_attn, hp)
    h = collapse(x, pre, w.attn_norm, hp.norm_eps)
    y = attention_rows(h, positions, w.attn, w.index, rows, plan, rope)
    return hc_post(x, y, post, comb), a_pre


def ffn_half(
    x: np.ndarray,
    pre: np.ndarray,
    w: V41LayerWeights,
    each: ExpertSource,
    mp: V41MoeParams,
    hp: HcParams,
    on_route: Callable[[np.ndarray], None] | None = None,
    rows: int | None = None,
    image: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Streams x (T, hc, D) and the attention half's pre (T, hc) -> (streams after the MoE, written
    into x; the next attention's pre (T, hc)). One MoE pass over all T tokens; the mixing runs `rows`
    tokens at a time to bound its temporaries. image (T,) bool: image-span tokens (routed with
    `gate.bias_vl`)."""
    t, hc, d = x.shape
    rows = rows or t
    h = np.empty((t, d), dtype=F32)
    f_pre = np.empty((t, hc), dtype=F32)
    post = np.empty((t, hc), dtype=F32)
    comb = np.empty((t, hc, hc), dtype=F32)
    for a in range(0, t, rows):
        b = min(t, a + rows)
        f_pre[a:b], post[a:b], comb[a:b] = hc_mixes(x[a:b], w.hc_ffn, hp)
        h[a:b] = collapse(x[a:b], pre[a:b], w.ffn_norm, hp.norm_eps)
    y = moe(h, w.moe, each, mp, on_route, image)
    del h
    for a in range(0, t, rows):
        b = min(t, a + rows)
        x[a:b] = hc_post(x[a:b], y[a:b], post[a:b], comb[a:b])
    return x, f_pre


def head_forward(
    x: np.ndarray, pre: np.ndarray, w: V41HeadWeights, norm_eps: float, extra: np.ndarray | None = None
) -> np.ndarray:
    """Streams x (T, hc, D) and the last FFN half's pre (T, hc) -> logits (T, vocab); `extra`
    (n, D): rows already normed that go through the same head call, their logits after the T
    rows (T + n, vocab)."""
    return head_logits(w.head, w.q8, collapse(x, pre, w.norm, norm_eps), extra)
