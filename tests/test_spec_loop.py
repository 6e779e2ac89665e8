"""The speculative loop's plain cycles cost what `off`'s steps cost (`engine.speculate`).

A reply under `--speculate auto` that drafts nothing (or watches now and then) must not be slower
than `off`: its plain cycles make the calls `Session.generate`'s loop makes per token (one
`Session.step`, two meter readings), not a one-token prefill (segment cuts, a hook per layer) and
two more meter readings per pass.
"""

from __future__ import annotations

from collections import Counter

import pytest

from dsv4stream.engine.session import Session
from dsv4stream.engine.spec_policy import FixedDrafts
from dsv4stream.engine.speculate import speculative_generate
from dsv4stream.engine.speculate_v41 import ScriptedDrafter
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.text.sampler import greedy
from tests.test_speculate_run import FIXTURE, budgets, prompt

N = 12


class Plain(FixedDrafts):
    """Never drafts: every cycle is a plain step."""

    def __init__(self) -> None:
        super().__init__(1)

    def most(self, kmax: int) -> int:
        return 0


@pytest.fixture(scope="module")
def rt():
    with Runtime.open(FIXTURE, RunOptions(budget=budgets()["resident"], threads=1)) as r:
        yield r


def counted(monkeypatch, rt, run) -> tuple[list[int], Counter]:
    """The ids of `run(session)` and the calls it made: Session.step / prefill / _forward and meter readings."""
    calls: Counter = Counter()
    for name in ("step", "prefill", "_forward"):
        orig = getattr(Session, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):
            calls[_name] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(Session, name, wrapped)
    s = rt.session()
    meter = s.engine.meter

    def counting_meter():
        calls["meter"] += 1
        return meter()

    monkeypatch.setattr(s.engine, "meter", counting_meter)
    try:
        ids = list(run(s))
    finally:
        monkeypatch.undo()
    return ids, calls


def test_a_plain_cycle_makes_offs_calls(monkeypatch, rt) -> None:
    """Per token, a reply that never drafts runs the calls `off` runs: one `step`, no prefill,
    the same forward passes and meter readings (before: a prefill per token with a hook per layer,
    and four meter readings a step where off takes two)."""
    off, want = counted(monkeypatch, rt, lambda s: s.generate(prompt(), N, greedy))
    never = ScriptedDrafter(lambda pos, tok, k: [], 5)
    ids, got = counted(
        monkeypatch, rt, lambda s: speculative_generate(s, prompt(), N, greedy, never, Plain(), setting="auto")
    )
    assert ids == off
    assert want["step"] == N - 1 and want["prefill"] == 1  # off: the prompt's prefill, then steps
    assert got == want, (got, want)


def test_the_estimate_without_drafts_counts_a_plain_cycles_whole_time() -> None:
    """`seconds_without`: tokens x the mean plain cycle (its pass and the loop's work around it,
    what off spends a token), not the pass alone (which read a reply that drafted nothing 4 %
    slower than its estimate on demo-v41); the pass alone before any plain cycle; summed runs
    keep both counts."""
    from dsv4stream.engine.spec_stats import SpecCounts

    s = SpecCounts(tokens=10, one_seconds=0.3, ones=10)  # (sums over the passes / cycles)
    assert s.seconds_without == pytest.approx(0.3)
    s.plain_seconds, s.plains = 0.33, 10
    assert s.seconds_without == pytest.approx(0.33)
    both = SpecCounts.total([s, SpecCounts(tokens=10, one_seconds=0.2, ones=5, plain_seconds=0.44, plains=4)])
    assert both.seconds_without == pytest.approx(20 * 0.77 / 14)


def test_a_reply_that_drafts_nothing_is_its_own_estimate_without(rt) -> None:
    """A reply whose every cycle is plain (a policy that never drafts or watches) reads its own
    decode time as the time without drafts."""
    never = ScriptedDrafter(lambda pos, tok, k: [], 5)
    s = rt.session()
    ids = list(speculative_generate(s, prompt(), 32, greedy, never, Plain(), setting="auto"))
    spec = s.turn.speculation
    assert len(ids) == 32 and spec.plains == spec.steps == spec.tokens == 31
    assert spec.seconds_without == pytest.approx(spec.seconds, rel=1e-9)  # the pass alone: 2-5 % less
