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

Batched: each expert chosen in a chunk runs once, as a matrix product, over all the chunk's
tokens that chose it; experts run in ascending id order so every token sums its experts in
the same order whatever the chunk size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import NumericsError
from ..kernels import QWeight, matmul, matmul_pair
from .ops import silu, sqrt_softplus, topk_lowest_index

F32 = np.float32


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
    chosen = np.take_along_axis(scores, experts, axis=1)
    weights = chosen / (chosen.sum(axis=1, keepdims=True) + F32(1e-20)) * F32(scaling)
    return experts, weights.astype(F32)


def swiglu(x: np.ndarray, e: ExpertWeights, limit: float) -> np.ndarray:
    """x (n, D) -> (n, D)."""
    gate, up = matmul_pair(e.w1, e.w3, x)  # one pass over both at one token
    gate = np.minimum(gate, F32(limit))
    up = np.clip(up, F32(-limit), F32(limit))
    return matmul(e.w2, silu(gate) * up)


def routed_experts(
    x: np.ndarray,
    experts: np.ndarray,
    weights: np.ndarray,
    get: Callable[[int], ExpertWeights],
    limit: float,
) -> np.ndarray:
    """Weighted sum of each token's experts: x (T, D), experts/weights (T, k) -> (T, D).

    get(expert) is called once per distinct expert, in ascending id order.
    """
    out = np.zeros_like(x)
    for e in np.unique(experts):
        tok, slot = np.nonzero(experts == e)
        y = swiglu(x[tok], get(int(e)), limit) * weights[tok, slot][:, None]
        np.add.at(out, tok, y)
    return out


def moe(
    x: np.ndarray,
    token_ids: np.ndarray,
    w: MoeWeights,
    get: Callable[[int], ExpertWeights],
    k: int,
    scaling: float,
    limit: float,
    on_route: Callable[[np.ndarray], None] | None = None,
) -> np.ndarray:
    """The whole FFN block: x (T, D) normed block input -> (T, D)."""
    experts, weights = route(x, token_ids, w, k, scaling)
    if on_route is not None:
        on_route(experts)
    return routed_experts(x, experts, weights, get, limit) + swiglu(x, w.shared, limit)
