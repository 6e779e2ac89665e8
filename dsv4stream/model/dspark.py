"""What the two DSpark drafter designs share (V4.1's `model.v41.dspark` and V4-Flash-0731's
`model.v4.dspark`): the record of one drafter run, the drafter's state between runs, and the
Markov and confidence heads that turn a run into draft logits and confidences.

Owns: `Draft` (one run at main position p: head logits before the Markov bias, or the head's
input rows where the caller runs the head itself, and the collapsed streams the confidence head
reads), `DSparkState` and `new_state` (per stage, the window of the
main model's keys), and `markov`. The stages' math is each family's; nothing here knows a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import matmul
from .cache import WindowCache

F32 = np.float32


@dataclass(frozen=True)
class Draft:
    """One run of the drafter at main position p."""

    logits: np.ndarray | None  # (n, vocab) head logits of the first n slots, before the Markov bias
    hidden: np.ndarray  # (B, D) the collapsed streams the confidence head reads
    # (n, D) the head's input rows (normed) instead of `logits`, where the run was asked to leave
    # the head to its caller (`engine.speculate` folds a watch's rows into the next pass's head call)
    rows: np.ndarray | None = None


@dataclass
class DSparkState:
    """Per stage, the window of main-model keys (positions <= the last observed one)."""

    windows: list[WindowCache]
    last: int = -1  # the last main position observed


def new_state(window: int, head_dim: int, stages: int) -> DSparkState:
    """A drafter state with nothing observed: `stages` empty windows of `window` keys of head_dim."""
    return DSparkState([WindowCache(window, head_dim) for _ in range(stages)])


def markov(d: Draft, chain: np.ndarray, w) -> tuple[np.ndarray, np.ndarray]:
    """Draft d and its chain (B,) (slot j's token: the block's first token, then each slot's
    pick) -> (logits (B, vocab) with the Markov bias, raw confidence (B,)). `w`: either design's
    weights (`markov_embed` (vocab, R), `markov_head` (vocab, R), `confidence` (D + R,))."""
    e = w.markov_embed[np.asarray(chain, dtype=np.int64)]  # (B, R)
    logits = d.logits + matmul(w.markov_head, e)
    conf = np.concatenate([d.hidden, e], axis=1).astype(F32) @ w.confidence
    return logits.astype(F32, copy=False), conf.astype(F32, copy=False)
