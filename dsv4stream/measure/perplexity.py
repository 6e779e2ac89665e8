"""Perplexity and the divergence of one numerics from another, as llama.cpp's
`llama-perplexity --kl-divergence` reports them (`dsv4 perplexity`; the command runs the model).

Owns the math only: from the logits of a run and the next tokens, each position's negative
log-likelihood; from a base run, a bounded record per position (its top `k` log-probabilities
and the log of the probability left outside them); from a tested run's logits and that record,
each position's KL(base || tested) and whether the two agree on the most likely token; and the
summary figures. Everything is float64 after the logits.

The KL is taken over the base's top k tokens plus one bucket for the rest: the exact KL of the
two distributions coarsened to those k + 1 outcomes. It is a lower bound of the full KL (equal
when the rest holds no probability, e.g. a vocabulary of at most k tokens) and exactly 0 when
the two runs give the same logits. Storing k values per position, not the vocabulary, keeps a
long text's base record small (k = 64: 1 kB per position).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOP_K = 64


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(n, V) -> (n, V) float64 log-probabilities."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def _rest(logp: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """log of the probability outside the columns idx (n, k) of each row; -inf when none is left."""
    masked = logp.copy()
    np.put_along_axis(masked, idx, -np.inf, axis=-1)
    m = np.max(masked, axis=-1)
    out = np.full(logp.shape[0], -np.inf)
    ok = np.isfinite(m)
    if ok.any():
        out[ok] = m[ok] + np.log(np.sum(np.exp(masked[ok] - m[ok, None]), axis=-1))
    return out


@dataclass
class BaseRecord:
    """What the base run keeps per scored position."""

    nll: np.ndarray  # (n,) -log p(next token)
    idx: np.ndarray  # (n, k) the top-k token ids, most likely first
    logp: np.ndarray  # (n, k) their log-probabilities
    rest: np.ndarray  # (n,) log of the probability of every other token (-inf: none)

    @staticmethod
    def concat(parts: list[BaseRecord]) -> BaseRecord:
        return BaseRecord(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("nll", "idx", "logp", "rest")))


def nll(logp: np.ndarray, targets: np.ndarray) -> np.ndarray:
    return -np.take_along_axis(logp, np.asarray(targets, dtype=np.int64)[:, None], axis=-1)[:, 0]


def record(logits: np.ndarray, targets: np.ndarray, k: int = TOP_K) -> BaseRecord:
    """The base run's record of positions whose logits are `logits` (n, V) and next tokens `targets`."""
    logp = log_softmax(logits)
    k = min(k, logp.shape[1])
    # ties broken by the lower id (a stable sort of -logp), so equal logits give equal records
    idx = np.argsort(-logp, axis=-1, kind="stable")[:, :k]
    return BaseRecord(nll(logp, targets), idx, np.take_along_axis(logp, idx, axis=-1), _rest(logp, idx))


@dataclass
class Compared:
    """A tested run's figures per position against the base record."""

    nll: np.ndarray  # (n,)
    kl: np.ndarray  # (n,) KL(base || tested) over the base's top k + the rest
    same_top: np.ndarray  # (n,) bool: the tested run's most likely token is the base's

    @staticmethod
    def concat(parts: list[Compared]) -> Compared:
        return Compared(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("nll", "kl", "same_top")))


def _plogq(p_log: np.ndarray, q_log: np.ndarray) -> np.ndarray:
    """p * (log p - log q) elementwise, 0 where p is 0 (log p = -inf)."""
    p = np.exp(p_log)
    with np.errstate(invalid="ignore"):
        d = np.where(p > 0, p_log - q_log, 0.0)
    return p * d


def compare(base: BaseRecord, logits: np.ndarray, targets: np.ndarray) -> Compared:
    """The tested run's logits (n, V) at the positions of `base`."""
    logp = log_softmax(logits)
    lq = np.take_along_axis(logp, base.idx, axis=-1)
    kl = np.sum(_plogq(base.logp, lq), axis=-1) + _plogq(base.rest, _rest(logp, base.idx))
    top = np.argmax(logp, axis=-1)
    # a tie for the top counts as agreement when the base's first choice is among the tied
    same = (top == base.idx[:, 0]) | (logp[np.arange(len(top)), base.idx[:, 0]] == logp[np.arange(len(top)), top])
    return Compared(nll(logp, targets), np.maximum(kl, 0.0), same)


def summary(base: BaseRecord, tested: Compared) -> dict:
    """The figures `dsv4 perplexity` prints and writes: perplexities, mean / median / p99 / max
    KL, top-1 agreement, and the mean difference of the log-likelihoods, over n positions."""
    n = int(base.nll.size)
    if n == 0:
        raise ValueError("no scored positions")
    kl = tested.kl
    return {
        "positions": n,
        "base_perplexity": float(np.exp(np.mean(base.nll))),
        "perplexity": float(np.exp(np.mean(tested.nll))),
        "mean_nll_difference": float(np.mean(tested.nll - base.nll)),
        "kl_mean": float(np.mean(kl)),
        "kl_median": float(np.median(kl)),
        "kl_p99": float(np.percentile(kl, 99)),
        "kl_max": float(np.max(kl)),
        "top1_agreement": float(np.mean(tested.same_top)),
    }
