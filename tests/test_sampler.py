"""The sampler's partial selections against the full stable sort they replace.

The references here sort the whole vocabulary (`np.argsort(-x, kind="stable")`, ids ascending
among equal values); the sampler selects partially. Logits with many exact ties, -inf entries
and a vocabulary-sized input make the boundary cases happen.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv4stream.text import sampler


def sorted_ref(x: np.ndarray) -> np.ndarray:
    return np.argsort(-x, kind="stable")


def top_k_ref(x: np.ndarray, k: int) -> np.ndarray:
    out = np.full_like(x, -np.inf)
    keep = sorted_ref(x)[:k]
    out[keep] = x[keep]
    return out


def top_p_ref(x: np.ndarray, p: float) -> np.ndarray:
    order = sorted_ref(x)
    cut = int(np.searchsorted(np.cumsum(sampler.softmax(x)[order]), p)) + 1
    out = np.full_like(x, -np.inf)
    out[order[:cut]] = x[order[:cut]]
    return out


def logits_cases(rng: np.random.Generator) -> list[np.ndarray]:
    vocab = rng.standard_normal(129_280).astype(np.float32) * 3
    ties = rng.integers(-3, 4, 5000).astype(np.float64)  # a handful of values, each thousands of times
    masked = rng.standard_normal(3000)
    masked[rng.random(3000) < 0.5] = -np.inf
    flat = np.zeros(300)  # all equal: the lowest ids must win
    peaked = rng.standard_normal(20_000)
    peaked[[7, 19_000]] = 40.0  # almost all the mass on two equal top logits
    return [vocab, ties, masked, flat, peaked]


@pytest.mark.parametrize("k", [1, 2, 5, 64, 299, 300, 1000])
def test_top_k_equals_the_full_sort(k):
    for x in logits_cases(np.random.default_rng(k)):
        if k < x.size:
            np.testing.assert_array_equal(sampler.top_ids(x, k), sorted_ref(x)[:k])
        np.testing.assert_array_equal(sampler.top_k_mask(x, k), top_k_ref(x, k))


@pytest.mark.parametrize("p", [1e-9, 0.1, 0.5, 0.9, 0.999, 0.9999999])
def test_top_p_equals_the_full_sort(p):
    for x in logits_cases(np.random.default_rng(int(p * 1000))):
        x = sampler.apply_temperature(x, 0.7)
        np.testing.assert_array_equal(sampler.top_p_mask(x, p), top_p_ref(x, p))


def test_whole_ladder_draws_the_same_ids_as_the_sorting_ladder():
    rng = np.random.default_rng(3)
    params = sampler.SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, seed=1)
    for x in logits_cases(rng):
        a, b = np.random.default_rng(5), np.random.default_rng(5)
        ref = sampler.min_p_mask(top_p_ref(top_k_ref(sampler.apply_temperature(x, 0.8), 50), 0.9), 0.01)
        for _ in range(20):
            assert sampler.sample(x, params, a) == sampler.draw(ref, b)


def test_nan_logits_keep_the_sort_order():
    x = np.array([0.5, np.nan, 2.0, 2.0, -1.0])
    np.testing.assert_array_equal(sampler.top_ids(x, 3), sorted_ref(x)[:3])
