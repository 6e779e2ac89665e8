"""Next-token choice from logits: a ladder of small pure functions and a seeded generator.

Order of the ladder: temperature -> top-k -> top-p (nucleus) -> min-p -> draw. Temperature
0 (or `greedy`) is argmax with ties broken toward the lower id, so greedy decoding is
identical across runs, thread counts and budgets.

Extremes, defined (the CLI and the server use this same code):
- The parameters are checked when made: a temperature that is not a finite number >= 0,
  top-k < 0, top-p outside (0, 1] or min-p outside [0, 1] is a UsageError.
- A temperature too small for the logits' float32 precision (below its smallest normal,
  about 1.2e-38, e.g. 1e-320) rounds to nothing: greedy. Any larger one samples; the
  scaled logits are taken relative to the top one, so nothing overflows, and a tiny
  temperature puts all the mass on the top logit (shared by exact ties).
- Logits that hold NaN or +inf at an id that may be picked are a NumericsError: no id is
  ever picked from a distribution that is not finite. -inf is a masked id. When every id
  that may be picked is -inf there is nothing to pick: NumericsError too.
- The draw only ever returns an id of nonzero probability (an id the ladder or the ban
  masked has none), whatever rounding does to the running sum.
- `make_pick` bans ids (the tokenizer's control tokens unless --allow-special, and the
  embedding rows past the tokenizer) before the ladder: greedy skips them too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import NumericsError, UsageError

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


# Temperatures below this round to nothing against float32 logits: greedy.
GREEDY_BELOW = float(np.finfo(np.float32).tiny)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
        if not _real(t) or not (0.0 <= t < np.inf):
            raise UsageError(f"temperature {t!r}: give a finite number, 0 (greedy) or more")
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
            raise UsageError(f"top-k {k!r}: give 0 (off) or a positive count")
        if not _real(p) or not (0.0 < p <= 1.0):
            raise UsageError(f"top-p {p!r}: give a probability in (0, 1]; 1 turns it off")
        if not _real(m) or not (0.0 <= m <= 1.0):
            raise UsageError(f"min-p {m!r}: give a fraction in [0, 1]; 0 turns it off")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _real(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | float | np.integer | np.floating)


def check_finite(logits: np.ndarray) -> None:
    """NumericsError unless every logit is finite or -inf and at least one is finite."""
    bad = np.isnan(logits) | np.isposinf(logits)
    if bad.any():
        where = np.flatnonzero(bad)
        raise NumericsError(
            f"the logits hold NaN or +inf at {where.size} ids (first {int(where[0])}); no id is picked from "
            "them: the weights or the forward pass are broken (try --verify)"
        )
    if not np.isfinite(logits).any():
        raise NumericsError("every id that may be picked has logit -inf: there is nothing to sample")


def greedy(logits: np.ndarray) -> int:
    """argmax, lowest id on ties (np.argmax returns the first maximum)."""
    return int(np.argmax(logits))


def softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - np.max(x)
    e = np.exp(z)
    return e / e.sum()


def apply_temperature(logits: np.ndarray, t: float) -> np.ndarray:
    """Logits / t, taken relative to the top logit (all <= 0, so no overflow at any t > 0)."""
    x = logits.astype(np.float64)
    return (x - np.max(x)) / t


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
    """One draw from softmax(logits) by inverse CDF over ids in ascending order; only an id of
    nonzero probability (the running sum's last step may round past u: then the last such id)."""
    probs = softmax(logits)
    csum = np.cumsum(probs)
    i = int(np.searchsorted(csum, rng.random() * csum[-1], side="right"))
    if i >= probs.size or not probs[i] > 0:
        i = int(np.flatnonzero(probs > 0)[-1])
    return i


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The whole ladder; `rng` is only consumed when not greedy. NumericsError for logits that
    are not finite (see the module docstring)."""
    logits = np.asarray(logits)
    check_finite(logits)
    if params.greedy:
        return greedy(logits)
    x = apply_temperature(logits, params.temperature)
    x = top_k_mask(x, params.top_k)
    x = top_p_mask(x, params.top_p)
    x = min_p_mask(x, params.min_p)
    return draw(x, rng)


def banned_ids(tok: Tokenizer | None, allow_special: bool = False) -> list[int]:
    """Ids never to sample: the tokenizer's control tokens (`Tokenizer.control_ids`: every
    added token but EOS, <think>, </think> and ｜DSML｜, whether marked special or not, so
    V4.1's <｜System｜>, its image token and placeholders too). None without a tokenizer
    (--prompt-ids) or with --allow-special."""
    if tok is None or allow_special:
        return []
    return tok.control_ids()


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
