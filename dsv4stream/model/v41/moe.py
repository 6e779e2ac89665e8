"""DeepSeek-V4.1's MoE block: router with a text and an image bias, routed and shared experts.

Owns: V4.1 routing and its SwiGLU expert math. Where the weights come from is the caller's
(`ExpertSource`, as in `model.moe`), so the streamed expert store stands behind it unchanged.

Facts this follows (DeepSeek's V4.1 inference code), against V4 (`model.moe`):
- every layer is scored (noaux_tc, no hash layers): scores = sqrt(softplus(gate x)) in float32;
  the experts are the top-k of scores + bias, with `gate.bias_vl` instead of `gate.bias` for
  tokens inside an image span; the weights are the chosen unbiased scores, divided by their
  sum (+1e-20) when norm_topk_prob and k > 1, times routed_scaling_factor.
- an expert: h = silu(min(w1 x, L)) * clip(w3 x, -L, L), multiplied by the token's routing
  weight *before* w2 (so under the official numerics the weighted h is what meets the FP8
  grid), then w2; the shared expert is the same without a weight. Every expert linear's input
  goes through the activation grid under the official numerics, once per distinct input.

Each token sums its experts in ascending id order, whatever order they arrive in (see
`model.moe`), and adds the shared expert last. Under `fast` numerics (no activation grid) the FP4
experts run on `kernels.experts_q8`'s layer drivers in their weight-before-w2 mode
(`model.moe.layer_sum`), with the bits of each expert's own products.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from ...errors import InternalError, NumericsError
from ...kernels import QWeight, get_numerics, matmul, matmul_pair
from ..moe import EXPERT_ROWS, ExpertSource, ExpertWeights, layer_sum
from ..ops import silu, sqrt_softplus, topk_lowest_index
from .quant import act_qdq

F32 = np.float32


@dataclass(frozen=True)
class V41MoeWeights:
    gate: QWeight  # router (n_routed_experts, D)
    bias: np.ndarray  # (n_routed_experts,) text tokens
    bias_vl: np.ndarray | None  # (n_routed_experts,) image-span tokens
    shared: ExpertWeights


@dataclass(frozen=True)
class V41MoeParams:
    k: int
    scaling: float
    limit: float
    norm_topk_prob: bool
    quantise: bool


def route(
    x: np.ndarray, w: V41MoeWeights, p: V41MoeParams, image: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """x (T, D) -> (experts (T, k) int64, weights (T, k) float32); image (T,) bool marks image-span tokens."""
    scores = sqrt_softplus(matmul(w.gate, x))  # (T, E)
    if not np.isfinite(scores).all():
        raise NumericsError("router scores (ffn.gate) are NaN or infinite")
    bias = np.broadcast_to(w.bias, scores.shape)
    if image is not None and w.bias_vl is not None:
        bias = np.where(image[:, None], w.bias_vl[None, :], bias)
    experts = topk_lowest_index(scores + bias, p.k)
    chosen = np.take_along_axis(scores, experts, axis=1)
    if p.norm_topk_prob and p.k > 1:
        chosen = chosen / (chosen.sum(axis=1, keepdims=True) + F32(1e-20))
    return experts, (chosen * F32(p.scaling)).astype(F32)


def _glu(gate: np.ndarray, up: np.ndarray, limit: float) -> np.ndarray:
    """silu(min(gate, L)) * clip(up, -L, L), in place on gate and up: (n, inter) twice -> (n, inter)."""
    np.minimum(gate, F32(limit), out=gate)
    np.clip(up, F32(-limit), F32(limit), out=up)
    h = silu(gate)
    h *= up
    return h


def swiglu(xq: np.ndarray, e: ExpertWeights, p: V41MoeParams, weight: np.ndarray | None = None) -> np.ndarray:
    """xq (n, D), already on the activation grid where the numerics ask -> (n, D); weight (n,) scales h."""
    gate, up = matmul_pair(e.w1, e.w3, xq)
    h = _glu(gate, up, p.limit)
    if weight is not None:
        h *= weight[:, None]
    return matmul(e.w2, act_qdq(h) if p.quantise else h)


def _rows(xq: np.ndarray, e: ExpertWeights, p: V41MoeParams, tok: np.ndarray | None, weight: np.ndarray | None):
    """`swiglu` of the rows `tok` of xq (all: None), EXPERT_ROWS at a time."""
    n = xq.shape[0] if tok is None else tok.size
    out = np.empty((n, xq.shape[1]), dtype=F32)
    for a in range(0, n, EXPERT_ROWS):
        rows = slice(a, a + EXPERT_ROWS) if tok is None else tok[a : a + EXPERT_ROWS]
        wt = None if weight is None else weight[a : a + EXPERT_ROWS]
        out[a : a + EXPERT_ROWS] = swiglu(xq[rows], e, p, wt)
    return out


def moe(
    x: np.ndarray,
    w: V41MoeWeights,
    each: ExpertSource,
    p: V41MoeParams,
    on_route: Callable[[np.ndarray], None] | None = None,
    image: np.ndarray | None = None,
) -> np.ndarray:
    """The FFN block: x (T, D) normed block input -> (T, D). Routing, then `on_route` (where the
    caller starts the expert reads), the shared expert (resident) while those reads land, then
    the routed experts as they arrive; the shared expert's output is added last."""
    experts, weights = route(x, w, p, image)
    if on_route is not None:
        on_route(experts)
    xq = act_qdq(x) if p.quantise else x
    shared = _rows(xq, w.shared, p, None, None)
    ids = np.unique(experts)
    if get_numerics() == "fast" and not p.quantise:
        own = partial(_own_rows, xq, p)
        glu = partial(_glu, limit=p.limit)
        out = layer_sum(xq, experts, weights, ids, each, glu, own, pre_weight=True, limit=p.limit)
        out += shared
        return out
    return _per_expert(xq, experts, weights, ids, each, p) + shared


def _own_rows(xq: np.ndarray, p: V41MoeParams, e: ExpertWeights, tok: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return _rows(xq, e, p, tok, weight)


def _per_expert(
    xq: np.ndarray, experts: np.ndarray, weights: np.ndarray, ids: np.ndarray, each: ExpertSource, p: V41MoeParams
) -> np.ndarray:
    """Each token's sum of its weighted experts, expert by expert in arrival order, summed in
    ascending id order from zero."""
    parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for e, ew in each(ids):
        tok, slot = np.nonzero(experts == e)
        parts[int(e)] = (tok, _rows(xq, ew, p, tok, weights[tok, slot]))
    missing = [int(e) for e in ids if int(e) not in parts]
    if missing:
        raise InternalError(f"expert source skipped experts {missing}")
    out = np.zeros_like(xq)
    for e in ids:
        tok, y = parts.pop(int(e))
        if tok.size > 1 and np.any(tok[1:] == tok[:-1]):
            np.add.at(out, tok, y)
        else:
            out[tok] += y
    return out
