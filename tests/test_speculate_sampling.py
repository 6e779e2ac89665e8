"""Sampled speculative decoding keeps the main model's distribution (issue 41), on a stand-in.

The main model here is a 4-token Markov chain (logits = a fixed table row of the last token),
behind the few `Session` calls `engine.speculate` makes; the drafter proposes tokens from its
own, different, chain. 4000 seeded replies of 3 tokens with 2 drafts per cycle: the frequencies
of the 64 possible replies against their exact probabilities under the main model (chi-square,
63 degrees of freedom, 0.1 % level), and the same count against a chain at another temperature
is refused (the test can fail). And with every draft right or every draft wrong the ids are the
same as with no drafts for the same seed.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np

from dsv4stream.engine.phases import PhaseLog, no_reads
from dsv4stream.engine.spec_draws import PositionUniforms
from dsv4stream.engine.spec_policy import FixedDrafts
from dsv4stream.engine.speculate import speculative_generate
from dsv4stream.engine.speculate_v41 import ScriptedDrafter
from dsv4stream.text.sampler import SamplingParams, make_pick, softmax

V = 4
TABLE = np.log(np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.4, 0.1], [0.7, 0.1, 0.1, 0.1]]))
PROMPT = [2]


class ChainEngine:
    meter = staticmethod(no_reads)

    def __init__(self) -> None:
        self.phases = PhaseLog()


class ChainSession:
    """A session of the Markov chain: the state is the ids fed."""

    def __init__(self) -> None:
        self.engine, self.trace, self.turn, self.stop_reason = ChainEngine(), None, None, ""
        self.ids: list[int] = []

    @property
    def pos(self) -> int:
        return len(self.ids)

    def prefill(self, ids) -> np.ndarray:
        self.ids.extend(int(i) for i in ids)
        return TABLE[np.asarray(ids)].astype(np.float32)

    def step(self, token_id: int) -> np.ndarray:
        return self.prefill([token_id])[0]

    def _timed_prefill(self, turn, t0, ids, *rest) -> np.ndarray:
        turn.prompt_tokens = len(ids)
        return self.prefill(ids)[-1]

    def read_ahead(self, ids) -> None:
        pass

    def snapshot(self) -> list[int]:
        return list(self.ids)

    def restore(self, snap: list[int]) -> None:
        self.ids = list(snap)


def reply(seed: int, k: int | None, drafts=None) -> tuple[int, ...]:
    u = PositionUniforms(seed)
    pick = make_pick(SamplingParams(temperature=1.0), V, u)
    s = ChainSession()
    if k is None:  # no drafts: pick after each one-token pass
        out, lg = [], s.prefill(PROMPT)[-1]
        for _ in range(3):
            u.at(s.pos)
            out.append(pick(lg))
            lg = s.prefill(out[-1:])[-1]
        return tuple(out)
    rng = np.random.default_rng(seed + 10**6)
    guess = drafts or (
        lambda pos, tok, n: [int(rng.integers(V)) if rng.random() < 0.5 else (tok + 1) % V for _ in range(n)]
    )
    return tuple(speculative_generate(s, PROMPT, 3, pick, ScriptedDrafter(guess, 4), FixedDrafts(k), uniforms=u))


def chi_square(counts: Counter, probs: dict) -> float:
    n = sum(counts.values())
    return sum((counts[c] - n * p) ** 2 / (n * p) for c, p in probs.items())


def exact(table: np.ndarray) -> dict:
    rows = [softmax(r) for r in table]
    out = {}
    for c in itertools.product(range(V), repeat=3):
        p, prev = 1.0, PROMPT[-1]
        for t in c:
            p, prev = p * rows[prev][t], t
        out[c] = p
    return out


def test_sampled_replies_follow_the_main_model() -> None:
    counts = Counter(reply(seed, 2) for seed in range(4000))
    df = V**3 - 1
    z = 3.09  # 0.1 % upper tail; Wilson-Hilferty's chi-square quantile
    limit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi_square(counts, exact(TABLE)) < limit
    assert chi_square(counts, exact(TABLE / 1.5)) > limit  # a different distribution is told apart


def test_sampled_ids_do_not_depend_on_the_drafts() -> None:
    for seed in range(50):
        plain = reply(seed, None)
        right = lambda pos, tok, n, plain=plain: list(plain[pos + 1 : pos + 1 + n])  # tok = plain[pos]
        wrong = lambda pos, tok, n, plain=plain: [(t + 1) % V for t in plain[pos + 1 : pos + 1 + n]]
        assert reply(seed, 2) == plain
        assert reply(seed, 3, right) == plain
        assert reply(seed, 1, wrong) == plain
