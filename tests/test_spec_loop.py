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
