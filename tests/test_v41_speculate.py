"""Speculative decoding with the DSpark drafter (issue 41): the same ids as without drafts.

On the drafter fixture (tests/fixtures/v41/dspark), both numerics: the checkpoint's own drafter
at k = 1..5 and `auto` (its random weights still accept some drafts: the greedy reply repeats),
and a stand-in drafter that proposes the main model's own greedy ids with 30 % of them wrong, so
that passes accept everything, nothing, and every length between (rollback and re-feed).
Sampled: with the position-keyed uniforms a seed gives the same ids as a run without drafts
picking with the same uniforms, whatever the draft length.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest

from dsv4stream.engine.session import Engine
from dsv4stream.engine.spec_draws import PositionUniforms
from dsv4stream.engine.spec_policy import AutoDrafts, FixedDrafts
from dsv4stream.engine.speculate import parse_setting, speculative_generate
from dsv4stream.engine.speculate_v41 import DSparkDrafter, ScriptedDrafter, speculative_greedy
from dsv4stream.engine.stack_v41 import V41Options
from dsv4stream.errors import UsageError
from dsv4stream.text.sampler import SamplingParams, make_pick

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
    assert st.drafted >= st.accepted and st.verify_passes >= 1
    assert st.tokens == N - 1 and st.verified_tokens == st.drafted + st.verify_passes


def stand_in(miss: float, seed: int):
    want = off("fp32")
    full = [*prompt().tolist(), *want]
    rng = np.random.default_rng(seed)

    def propose(pos: int, token: int, n: int) -> list[int]:
        assert token == full[pos + 1]
        return [full[pos + 2 + j] if rng.random() >= miss else (full[pos + 2 + j] + 1) % 64 for j in range(n)]

    return propose


@pytest.mark.parametrize("k", [1, 3, 5])
def test_stand_in_with_misses_equals_off(k: int) -> None:
    ids, st = speculative_greedy(engine("fp32"), prompt(), N, k, propose=stand_in(0.3, k))
    assert ids == off("fp32")
    assert st.accepted > 0 and st.refeeds > 0
    assert st.cycles < N - 1  # fewer main-model passes than one per token


def test_auto_greedy_equals_off() -> None:
    """auto drafts what pays (a stand-in that is always right: it drafts) and still equals off."""
    ids, st = speculative_greedy(engine("fp32"), prompt(), N, 5, propose=stand_in(0.0, 0), policy=AutoDrafts(5))
    assert ids == off("fp32") and st.accepted > 0
    ids, _ = speculative_greedy(engine("fp32"), prompt(), N, 5, policy=AutoDrafts(5))
    assert ids == off("fp32")


def test_auto_watches_instead_of_verifying_drafts_that_are_never_right() -> None:
    """A drafter that is never right: auto learns it from watches (drafts compared with the picks,
    never fed) and verifies no draft at all, so no pass is longer than off's; a drafter that is
    always right: its watches are all right and it verifies drafts."""
    ids, st = speculative_greedy(engine("fp32"), prompt(), N, 5, propose=stand_in(1.0, 0), policy=AutoDrafts(5))
    assert ids == off("fp32")
    assert st.watches >= 1 and st.watch_accepted == 0 and st.watch_drafted >= 1
    assert st.drafted == 0 and st.verify_passes == 0 and st.refeeds == 0 and st.steps == N - 1
    ids, st = speculative_greedy(engine("fp32"), prompt(), N, 5, propose=stand_in(0.0, 0), policy=AutoDrafts(5))
    assert ids == off("fp32")
    assert st.watches >= 1 and st.watch_accepted == st.watch_drafted
    assert st.accepted > 0


def test_draft_length_is_checked() -> None:
    for k in (0, 6):
        with pytest.raises(UsageError):
            speculative_greedy(engine("fp32"), prompt(), N, k)
    assert parse_setting("auto") == "auto" and parse_setting("OFF") == "off" and parse_setting(0) == "off"
    assert parse_setting("3", most=5) == 3
    for bad in ("fast", -1, 1.5, True, None):
        with pytest.raises(UsageError, match="--speculate"):
            parse_setting(bad)
    with pytest.raises(UsageError, match="at most 5"):
        parse_setting(6, most=5)


def sampled(k: int | None, seed: int, propose=None) -> list[int]:
    """Temperature-1 top-k ids: with drafts (k), or without (None), the same position uniforms."""
    eng = engine("fp32")
    u = PositionUniforms(seed)
    pick = make_pick(SamplingParams(temperature=1.0, top_k=8), 64, u)
    s = eng.session(chunk_size=64)
    if k is None:
        return list(s.generate(prompt(), N, lambda lg: (u.at(s.pos), pick(lg))[1]))
    d = DSparkDrafter(eng) if propose is None else ScriptedDrafter(propose, 5)
    return list(speculative_generate(s, prompt(), N, pick, d, FixedDrafts(k), uniforms=u))


@pytest.mark.parametrize("seed", [1, 2])
def test_sampled_same_ids_whatever_the_draft_length(seed: int) -> None:
    want = sampled(None, seed)
    for k in (1, 2, 4):
        assert sampled(k, seed) == want
    full = [*prompt().tolist(), *want]
    right = lambda pos, token, n: full[pos + 2 : pos + 2 + n]  # the main model's own sampled ids
    assert sampled(3, seed, right) == want


def test_closing_mid_pass_leaves_the_session_as_without_drafts() -> None:
    """A caller that stops after the 2nd token of an accepted block: the session holds the prompt
    and the 1st reply token only (every yielded token but the last fed), so it continues as off."""
    eng = engine("fp32")
    want = off("fp32")
    full = [*prompt().tolist(), *want]
    s = eng.session(chunk_size=64)
    drafter = ScriptedDrafter(lambda pos, token, n: full[pos + 2 : pos + 2 + n], 5)
    gen = speculative_generate(s, prompt(), N, lambda lg: int(np.argmax(lg)), drafter, FixedDrafts(4))
    got = [next(gen), next(gen), next(gen)]
    gen.close()
    assert got == want[:3] and s.pos == len(prompt()) + 2
    assert list(s.generate([got[-1]], 3)) == want[3:6]


def test_stop_inside_a_pass() -> None:
    """A stop id that a verification pass accepts mid-block ends the reply there, state as off."""
    want = off("fp32")
    stop = want[5]
    full = [*prompt().tolist(), *want]
    s = engine("fp32").session(chunk_size=64)
    drafter = ScriptedDrafter(lambda pos, token, n: full[pos + 2 : pos + 2 + n], 5)
    got = list(
        speculative_generate(s, prompt(), N, lambda lg: int(np.argmax(lg)), drafter, FixedDrafts(5), stop_ids=(stop,))
    )
    assert got == want[: want.index(stop) + 1] and s.stop_reason == "eos"
    assert s.pos == len(prompt()) + len(got) - 1


@pytest.mark.parametrize("after", [2, 3, 5, 8])
def test_closing_after_rejections_leaves_the_session_as_without_drafts(after: int) -> None:
    """Kept tokens of a rejected pass wait to open the next pass; a caller that stops at any token
    still finds every token before it fed (the carried ones included)."""
    want = off("fp32")
    s = engine("fp32").session(chunk_size=64)
    drafter = ScriptedDrafter(stand_in(0.3, after), 5)
    gen = speculative_generate(s, prompt(), N, lambda lg: int(np.argmax(lg)), drafter, FixedDrafts(3))
    got = [next(gen) for _ in range(after)]
    gen.close()
    assert got == want[:after] and s.pos == len(prompt()) + after - 1
    assert list(s.generate([got[-1]], 3)) == want[after : after + 3]


def test_plain_steps_go_through_the_thread_governor() -> None:
    """Where auto drafts nothing, its one-token passes are the governor's decode steps, as off's."""
    from dsv4stream import kernels
    from dsv4stream.engine.threads import ThreadGovernor

    eng = Engine.open(FIXTURE, v41=V41Options(numerics="fp32"), threads=2)
    eng.governor = ThreadGovernor(2)
    try:
        ids, st = speculative_greedy(eng, prompt(), N, 5, policy=AutoDrafts(5))
    finally:
        kernels.set_threads(1)
    assert ids == off("fp32")
    assert sum(eng.governor.summary().values()) == st.steps > 0
