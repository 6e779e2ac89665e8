"""The MoE feed-forward block: router, routed experts, shared expert.

Owns: routing (which experts, with what weights) and the SwiGLU expert math. It does not
own where expert weights come from: the caller passes a function (layer, expert) ->
ExpertWeights, so a streaming store can stand behind it.

Facts this follows: scores = sqrt(softplus(gate.weight x)); scored layers pick the top-k
of scores + gate.bias (the bias steers selection only), hash layers take tid2eid[token];
in both, the weights are the chosen *unbiased* scores normalised to sum 1, times
routed_scaling_factor. Expert: w2(silu(min(w1 x, L)) * clip(w3 x, -L, L)) with
L = swiglu_limit (the gate is clamped from above only). The shared expert uses the same
clamped SwiGLU and is added with weight 1.

Batched: each expert chosen by a batch of tokens runs once, as a matrix product, over all
the batch's tokens that chose it. The experts may arrive in any order (the shared expert
first, then those already in memory, then the rest as their reads land); each one's
weighted output is kept, and every token sums its experts in ascending id order at the
end, so the sum, hence the logits, never depend on the arrival order, the cache size or
the batch size. Under `fast` numerics the FP4 experts run on `kernels.experts_q8`'s layer-wide
drivers instead, a group of experts per pair of calls (a `GroupedSource` hands the experts the
store holds together: all of a layer's when they are in memory and fit), with the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np

from ..errors import InternalError, NumericsError
from ..kernels import QWeight, get_numerics, matmul, matmul_pair, q8_expert_variant, q8_layer
from .ops import silu, sqrt_softplus, topk_lowest_index

F32 = np.float32
# Token rows per expert matrix product: bounds the temporaries when many tokens pick one expert.
EXPERT_ROWS = 256

# Given the distinct experts (ascending), yields (expert, weights) once each, in any order; an
# expert's weights are valid until the iterator advances (a streamed expert's slot is reused).
ExpertSource = Callable[[np.ndarray], Iterable[tuple[int, "ExpertWeights"]]]
# The same experts in groups [(expert, weights), ...]: a group's weights all valid until the
# iterator advances (`GroupedSource`).
ExpertGroups = Callable[[np.ndarray], Iterable[list[tuple[int, "ExpertWeights"]]]]


class GroupedSource:
    """An `ExpertSource` that can also hand the experts in groups pinned together (`groups`), so
    the MoE can run a group's experts in one kernel call; called as an `ExpertSource`, it yields
    the groups' items one by one."""

    __slots__ = ("groups",)

    def __init__(self, groups: ExpertGroups) -> None:
        self.groups = groups

    def __call__(self, ids: np.ndarray) -> Iterator[tuple[int, ExpertWeights]]:
        for group in self.groups(ids):
            yield from group


@dataclass(frozen=True)
class ExpertWeights:
    w1: QWeight  # gate (inter, D)
    w2: QWeight  # down (D, inter)
    w3: QWeight  # up (inter, D)


@dataclass(frozen=True)
class MoeWeights:
    gate: QWeight  # router (n_routed_experts, D)
    bias: np.ndarray | None  # (n_routed_experts,) scored layers
    tid2eid: np.ndarray | None  # (vocab, k) int64, hash layers
    shared: ExpertWeights


def route(x: np.ndarray, token_ids: np.ndarray, w: MoeWeights, k: int, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """x (T, D) -> (experts (T, k) int64, weights (T, k) float32)."""
    scores = sqrt_softplus(matmul(w.gate, x))  # (T, E)
    if not np.isfinite(scores).all():  # NaN would otherwise pick experts and weights silently
        raise NumericsError("router scores (ffn.gate) are NaN or infinite")
    if w.tid2eid is not None:
        experts = w.tid2eid[token_ids].astype(np.int64)
    else:
        experts = topk_lowest_index(scores + w.bias, k)
    chosen = scores[np.arange(scores.shape[0])[:, None], experts]  # take_along_axis, minus its wrappers
    weights = chosen / (chosen.sum(axis=1, keepdims=True) + F32(1e-20)) * F32(scaling)
    return experts, weights.astype(F32)


def _glu(gate: np.ndarray, up: np.ndarray, limit: float) -> np.ndarray:
    """silu(min(gate, L)) * clip(up, -L, L), in place where it can: (n, inter) twice -> (n, inter)."""
    np.minimum(gate, F32(limit), out=gate)
    np.minimum(np.maximum(up, F32(-limit), out=up), F32(limit), out=up)  # np.clip's bits, NaN kept
    h = silu(gate)
    h *= up
    return h


def swiglu(x: np.ndarray, e: ExpertWeights, limit: float) -> np.ndarray:
    """x (n, D) -> (n, D)."""
    gate, up = matmul_pair(e.w1, e.w3, x)  # one pass over both at one token
    return matmul(e.w2, _glu(gate, up, limit))


def weighted_swiglu(x: np.ndarray, e: ExpertWeights, limit: float, w: np.ndarray) -> np.ndarray:
    """`swiglu(x, e, limit) * w[:, None]` for x (n, D), w (n,) float32."""
    y = swiglu(x, e, limit)
    y *= w[:, None]
    return y


def swiglu_rows(x: np.ndarray, e: ExpertWeights, limit: float, tok: np.ndarray | None = None) -> np.ndarray:
    """`swiglu` of the rows `tok` of x (all rows: None), EXPERT_ROWS at a time: -> (len(tok), D)."""
    n = x.shape[0] if tok is None else tok.size
    if n <= EXPERT_ROWS:
        return swiglu(x if tok is None else x[tok], e, limit)
    out = np.empty((n, x.shape[1]), dtype=F32)
    for a in range(0, n, EXPERT_ROWS):
        rows = slice(a, a + EXPERT_ROWS) if tok is None else tok[a : a + EXPERT_ROWS]
        out[a : a + EXPERT_ROWS] = swiglu(x[rows], e, limit)
    return out


def _weighted_rows(x: np.ndarray, e: ExpertWeights, limit: float, tok: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`weighted_swiglu` of the rows `tok` of x with their weights w (tok.size,), EXPERT_ROWS at a
    time: -> (tok.size, D)."""
    if tok.size <= EXPERT_ROWS:
        return weighted_swiglu(x[tok], e, limit, w)
    out = np.empty((tok.size, x.shape[1]), dtype=F32)
    for a in range(0, tok.size, EXPERT_ROWS):
        out[a : a + EXPERT_ROWS] = weighted_swiglu(x[tok[a : a + EXPERT_ROWS]], e, limit, w[a : a + EXPERT_ROWS])
    return out


def routed_experts(
    x: np.ndarray,
    experts: np.ndarray,
    weights: np.ndarray,
    each: ExpertSource,
    limit: float,
) -> np.ndarray:
    """Weighted sum of each token's experts: x (T, D), experts/weights (T, k) -> (T, D).

    each(distinct experts) hands every chosen expert once, in any order; the sum runs in
    ascending expert id order whatever that order was. Under `fast` numerics the FP4 experts
    run on `kernels.experts_q8`'s drivers (`_layer`), a group of experts per call."""
    ids = np.unique(experts)
    if get_numerics() == "fast":
        return _layer(x, experts, weights, ids, each, limit)
    if x.shape[0] == 1 and ids.size == experts.shape[1]:
        return _one_token(x, experts[0], weights[0], ids, each, limit)
    parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for e, ew in each(ids):
        tok, slot = np.nonzero(experts == e)
        parts[int(e)] = (tok, _weighted_rows(x, ew, limit, tok, weights[tok, slot]))
    _check_all(ids, parts)
    return _sum_parts(x, ids, parts)


def _check_all(ids: np.ndarray, got) -> None:
    missing = [int(e) for e in ids if int(e) not in got]
    if missing:
        raise InternalError(f"expert source skipped experts {missing}")


def _sum_parts(x: np.ndarray, ids: np.ndarray, parts: dict[int, tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Each token's weighted expert outputs parts[e] = (its tokens, rows) summed in ascending id order."""
    out = np.zeros_like(x)
    for e in ids:
        tok, y = parts.pop(int(e))
        if tok.size > 1 and np.any(tok[1:] == tok[:-1]):  # a token listing one expert twice
            np.add.at(out, tok, y)
        else:
            out[tok] += y
    return out


def _layer(
    x: np.ndarray, experts: np.ndarray, weights: np.ndarray, ids: np.ndarray, each: ExpertSource, limit: float
) -> np.ndarray:
    """`routed_experts` under `fast` numerics, the same bits as each expert's own products."""
    return layer_sum(
        x,
        experts,
        weights,
        ids,
        each,
        partial(_glu, limit=limit),
        lambda ew, tok, w: _weighted_rows(x, ew, limit, tok, w),
        limit=limit,
    )


def layer_sum(
    x: np.ndarray,
    experts: np.ndarray,
    weights: np.ndarray,
    ids: np.ndarray,
    each: ExpertSource,
    glu: Callable[[np.ndarray, np.ndarray], np.ndarray],
    own: Callable[[ExpertWeights, np.ndarray, np.ndarray], np.ndarray],
    pre_weight: bool = False,
    limit: float | None = None,
) -> np.ndarray:
    """Each token's sum of its weighted experts (T, D) under `fast` numerics, on the drivers.

    The FP4 experts go to one `experts_q8.Layer`: a source that can (`GroupedSource`) hands the
    experts in groups pinned together (all of a layer's at once when they are in memory and fit
    the free slots), the others one at a time; a whole layer in one group takes two driver
    calls, more groups two calls per group (of at most `PAIR_ROWS` pairs) and one for the sum.
    glu(gate, up): the elementwise middle; an expert the drivers do not take runs
    own(expert, its tokens, their weights) -> its weighted rows. `pre_weight`: the routing weight
    multiplies h before w2 (V4.1) instead of w2's output (V4). `limit`: glu is `_glu` at this
    limit, so a whole layer's drivers run the SwiGLU themselves (`experts_q8.swiglu_sum`)."""
    groups = each.groups(ids) if isinstance(each, GroupedSource) else ([item] for item in each(ids))
    layer = None
    parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    seen: set[int] = set()
    out = None
    for group in groups:
        drive = []
        for e, ew in group:
            seen.add(int(e))
            v = q8_expert_variant(ew)
            if v is None:
                tok, slot = np.nonzero(experts == e)
                parts[int(e)] = (tok, own(ew, tok, weights[tok, slot]))
            else:
                drive.append((int(e), ew))
                if layer is None:
                    layer = q8_layer(v, x, experts, weights, glu, ew.w1.role, pre_weight=pre_weight, limit=limit)
        if drive:
            out = layer.whole(drive) if not parts else None
            if out is None:
                layer.group(drive)
    _check_all(ids, seen)
    if layer is None:
        return _sum_parts(x, ids, parts)
    if out is not None:
        return out
    for e, (tok, y) in parts.items():  # tok ascending (np.nonzero), so in the layer's pair order
        layer.put(e, y)
    return layer.total()


def _one_token(
    x: np.ndarray, experts: np.ndarray, weights: np.ndarray, ids: np.ndarray, each: ExpertSource, limit: float
) -> np.ndarray:
    """`routed_experts` of one token x (1, D) choosing k distinct experts (k,) with weights (k,):
    the same products and sums, in the same order (ascending id, from zeros), as the general
    path, without its per-expert row gathers (a decode step's ~24 experts)."""
    slot = {int(e): j for j, e in enumerate(experts.tolist())}
    parts: dict[int, np.ndarray] = {}
    for e, ew in each(ids):
        parts[int(e)] = weighted_swiglu(x, ew, limit, weights[slot[int(e)]].reshape(1))
    _check_all(ids, parts)
    out = np.zeros_like(x)
    for e in ids.tolist():
        out += parts.pop(e)
    return out


def moe(
    x: np.ndarray,
    token_ids: np.ndarray,
    w: MoeWeights,
    each: ExpertSource,
    k: int,
    scaling: float,
    limit: float,
    on_route: Callable[[np.ndarray], None] | None = None,
) -> np.ndarray:
    """The whole FFN block: x (T, D) normed block input -> (T, D).

    Routing first, then `on_route` (where the caller starts the reads), then the shared
    expert, whose weights are resident, while those reads land; then the routed ones."""
    experts, weights = route(x, token_ids, w, k, scaling)
    if on_route is not None:
        on_route(experts)
    shared = swiglu_rows(x, w.shared, limit)
    out = routed_experts(x, experts, weights, each, limit)
    out += shared
    return out
