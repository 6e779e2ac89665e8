"""Greedy speculative decoding with the DSpark drafter (issue 41): the same ids as without drafts.

On the drafter fixture (tests/fixtures/v41/dspark), both numerics: the checkpoint's own drafter
at k = 1..5 (its random weights still accept some drafts: the greedy reply repeats), and a
stand-in drafter that proposes the main model's own greedy ids with 30 % of them wrong, so
that passes accept everything, nothing, and every length between (rollback and re-feed).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest

from dsv4stream.engine.session import Engine
from dsv4stream.engine.speculate_v41 import speculative_greedy
from dsv4stream.engine.stack_v41 import V41Options
from dsv4stream.errors import UsageError

FIXTURE = Path(__file__).parent / "fixtures" / "v41" / "dspark"
N = 20


@cache
def engine(numerics: str) -> Engine:
    return Engine.open(FIXTURE, v41=V41Options(numerics=numerics), threads=1)


@cache
def prompt() -> np.ndarray:
    with np.load(FIXTURE / "draft.npz") as z:
        return z["token_ids"][:8]


@cache
def off(numerics: str) -> list[int]:
    return list(engine(numerics).session(chunk_size=64).generate(prompt(), N))


@pytest.mark.parametrize("numerics", ["fp32", "official"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_drafter_greedy_equals_off(numerics: str, k: int) -> None:
    ids, st = speculative_greedy(engine(numerics), prompt(), N, k)
    assert ids == off(numerics)
    assert st.drafted >= st.accepted and st.passes >= 1


@pytest.mark.parametrize("k", [1, 3, 5])
def test_stand_in_with_misses_equals_off(k: int) -> None:
    want = off("fp32")
    full = [*prompt().tolist(), *want]
    rng = np.random.default_rng(k)

    def stand_in(pos: int, token: int, n: int) -> list[int]:
        assert token == full[pos + 1]
        return [full[pos + 2 + j] if rng.random() > 0.3 else (full[pos + 2 + j] + 1) % 64 for j in range(n)]

    ids, st = speculative_greedy(engine("fp32"), prompt(), N, k, propose=stand_in)
    assert ids == want
    assert st.accepted > 0 and st.refeeds > 0
    assert st.passes < N - 1  # fewer main-model passes than one per token


def test_draft_length_is_checked() -> None:
    for k in (0, 6):
        with pytest.raises(UsageError):
            speculative_greedy(engine("fp32"), prompt(), N, k)
