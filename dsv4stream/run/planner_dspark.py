"""The DSpark drafter's share of a plan: whether a run drafts, its dense bytes, its experts.

Owns the one rule `run.memory` (measured on the shards) and `run.planner.needs_from_config`
(estimated from config.json) both apply, so `dsv4 inspect --config-only` budgets the drafter as
`dsv4 run` does: a run drafts unless --speculate is off or the checkpoint has no drafter this
code runs (`weights.loading_dspark.drafter_reason`); it then holds every mtp.* tensor but the
routed experts, as stored except the Markov embedding (V4.1 `markov_head.embed`, 0731
`markov_head.markov_w1`) and the confidence head, which the loaders widen to float32, and its
stages' routed experts count in the expert slots (blocks n_layers + K).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ..checkpoint.config import ModelConfig
from ..checkpoint.spec import model_specs
from ..checkpoint.tensors import released_nbytes
from ..weights.loading_dspark import drafter_reason

WIDENED = ("markov_head.embed.", "markov_head.markov_w1.", "confidence_head.")


def drafts(cfg: ModelConfig, speculate: str | int) -> bool:
    """Whether a run with this --speculate setting holds the drafter."""
    return speculate != "off" and drafter_reason(cfg) is None


def dense_bytes(tensors: Iterable[tuple[str, tuple[int, ...], int]]) -> int:
    """(name, shape, stored bytes) of the drafter's dense tensors -> the bytes its loader holds."""
    return sum(4 * math.prod(shape) if any(w in name for w in WIDENED) else nbytes for name, shape, nbytes in tensors)


def dense_bytes_from_config(cfg: ModelConfig) -> int:
    """`dense_bytes` of the release dtypes, from config.json alone."""
    return dense_bytes(
        (s.name, s.shape, released_nbytes(cfg, s))
        for s in model_specs(cfg, with_experts=False)
        if s.layer is not None and s.layer >= cfg.n_layers
    )


def drafter_experts(cfg: ModelConfig) -> int:
    """Routed experts of the drafter's stages (they share the main model's expert slots)."""
    return sum(cfg.experts_of(cfg.n_layers + k)[0] for k in range(cfg.n_mtp))
