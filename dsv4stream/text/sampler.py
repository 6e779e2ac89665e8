"""Next-token choice from logits: a ladder of small pure functions and a seeded generator.

Order of the ladder: temperature -> top-k -> top-p (nucleus) -> min-p -> draw. Temperature
0 (or `greedy`) is argmax with ties broken toward the lower id, so greedy decoding is
identical across runs, thread counts and budgets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def greedy(logits: np.ndarray) -> int:
    """argmax, lowest id on ties (np.argmax returns the first maximum)."""
    return int(np.argmax(logits))


def softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - np.max(x)
    e = np.exp(z)
    return e / e.sum()


def apply_temperature(logits: np.ndarray, t: float) -> np.ndarray:
    return logits.astype(np.float64) / t


def top_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits in descending order, equal values by ascending id: exactly
    `np.argsort(-logits, kind="stable")[:k]`, by a partial selection (O(vocab), not a sort)."""
    n = logits.size
    if k >= n or np.isnan(logits).any():  # NaN sorts last in argsort; keep its exact order
        return np.argsort(-logits, kind="stable")[:k]
    if k <= 0:
        return np.zeros(0, dtype=np.intp)
    v = logits[np.argpartition(-logits, k - 1)[k - 1]]  # the k-th largest value
    above = np.flatnonzero(logits > v)
    keep = np.concatenate([above, np.flatnonzero(logits == v)[: k - above.size]])
    return keep[np.argsort(-logits[keep], kind="stable")]


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest logits (ties at the boundary: lower ids first); others -inf."""
    if k <= 0 or k >= logits.size:
        return logits
    keep = top_ids(logits, k)
    out = np.full_like(logits, -np.inf)
    out[keep] = logits[keep]
    return out


def top_p_mask(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of top tokens whose probability reaches p (always >= 1 token).

    The candidates are taken 64, 256, ... at a time in sorted order until their running sum
    reaches p: the same prefix of the same running sum as a full sort gives, so the same cut."""
    if p >= 1.0:
        return logits
    probs = softmax(logits)
    m = 64
    while True:
        order = top_ids(logits, m)
        csum = np.cumsum(probs[order])
        if m >= logits.size or csum[-1] >= p:
            break
        m *= 4
    cut = int(np.searchsorted(csum, p)) + 1
    out = np.full_like(logits, -np.inf)
    keep = order[:cut]
    out[keep] = logits[keep]
    return out


def min_p_mask(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens whose probability is below min_p times the top token's probability."""
    if min_p <= 0.0:
        return logits
    probs = softmax(logits)
    out = logits.copy()
    out[probs < min_p * probs.max()] = -np.inf
    return out


def draw(logits: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from softmax(logits) by inverse CDF over ids in ascending order."""
    probs = softmax(logits)
    u = rng.random()
    return int(min(np.searchsorted(np.cumsum(probs), u, side="right"), probs.size - 1))


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The whole ladder; `rng` is only consumed when not greedy."""
    if params.greedy:
        return greedy(logits)
    x = apply_temperature(np.asarray(logits), params.temperature)
    x = top_k_mask(x, params.top_k)
    x = top_p_mask(x, params.top_p)
    x = min_p_mask(x, params.min_p)
    return draw(x, rng)


def banned_ids(tok: Tokenizer | None, allow_special: bool = False) -> list[int]:
    """Ids never to sample: those the tokenizer marks special, except EOS (which ends the
    answer). None without a tokenizer (--prompt-ids) or with --allow-special."""
    if tok is None or allow_special:
        return []
    return [i for i in tok.special_ids() if i != tok.special.eos]


def make_pick(
    params: SamplingParams, n_ids: int, rng: np.random.Generator, banned: list[int] | None = None
) -> Callable[[np.ndarray], int]:
    """The sampler over ids 0..n_ids-1 (the embedding may have rows no token prints) less
    `banned` (their logits become -inf before the ladder, so greedy skips them too)."""
    ban = np.asarray([i for i in banned or () if i < n_ids], dtype=np.int64)

    def pick(logits: np.ndarray) -> int:
        x = logits[:n_ids]
        if ban.size:
            x = x.copy()
            x[ban] = -np.inf
        return sample(x, params, rng)

    return pick
