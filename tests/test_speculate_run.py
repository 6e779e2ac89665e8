"""`--speculate` within a budgeted run (issue 41): the drafter in the plan, the same greedy ids as
off at a budget where everything is resident and at one where experts stream, `auto` off silently
where there is no drafter, an explicit N refused there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.errors import UsageError
from dsv4stream.run import planner
from dsv4stream.run.memory import measure
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime

FIXTURE = Path(__file__).parent / "fixtures" / "v41" / "dspark"
N = 16


def prompt() -> list[int]:
    with np.load(FIXTURE / "draft.npz") as z:
        return [int(i) for i in z["token_ids"][:8]]


def budgets() -> dict[str, int]:
    n = measure(FIXTURE, RunOptions(budget=1))
    ws = Catalog.open(FIXTURE).config.working_set_experts
    return {"resident": planner.budget_for(n, n.total_experts), "streaming": planner.budget_for(n, 2 * ws)}


@pytest.mark.parametrize("where", ["resident", "streaming"])
def test_greedy_ids_equal_off_at_two_budgets(where: str) -> None:
    with Runtime.open(FIXTURE, RunOptions(budget=budgets()[where], threads=1)) as rt:
        assert any("drafter: DSpark dense weights" in line for line in rt.plan.lines())
        assert not rt.plan.needs.unused or "DSpark" not in rt.plan.needs.unused
        off = list(rt.generate(rt.session(), prompt(), N, speculate="off"))
        for setting in (1, 2, 3, 4, 5, "auto"):
            assert list(rt.generate(rt.session(), prompt(), N, speculate=setting)) == off, setting
        spec = rt.stats().phases.speculation
        assert spec is not None and spec.drafted > 0 and spec.tokens > 0
        if where == "streaming":
            assert rt.store.stats().bytes_read > 0


def test_off_leaves_the_drafter_out_of_the_plan() -> None:
    n_off = measure(FIXTURE, RunOptions(budget=1, speculate="off"))
    n_on = measure(FIXTURE, RunOptions(budget=1))
    assert n_off.drafter_bytes == 0 and n_on.drafter_bytes > 0
    assert n_on.fixed_bytes - n_off.fixed_bytes == n_on.drafter_bytes
    assert "DSpark drafter" in (n_off.unused or "") and "DSpark drafter" not in (n_on.unused or "")


def test_no_drafter_auto_is_off_and_n_is_refused(tiny_v4) -> None:
    n = measure(tiny_v4, RunOptions(budget=1))
    assert n.drafter_bytes == 0
    budget = planner.budget_for(n, 2 * Catalog.open(tiny_v4).config.working_set_experts)
    with Runtime.open(tiny_v4, RunOptions(budget=budget)) as rt:
        assert rt.speculator.default == "off"
        off = list(rt.generate(rt.session(), [1, 2, 3], 4, speculate="auto"))
        assert off == list(rt.generate(rt.session(), [1, 2, 3], 4, speculate="off"))
        with pytest.raises(UsageError, match="cannot draft"):
            rt.generate(rt.session(), [1, 2, 3], 4, speculate=2)
    with pytest.raises(UsageError, match="cannot draft"):
        Runtime.open(tiny_v4, RunOptions(budget=budget, speculate=3))


def test_cli_checks_speculate_before_loading(tiny_v4, tmp_path) -> None:
    """`dsv4 run --speculate`: a bad value or a draft length the checkpoint cannot run is one
    UsageError before anything loads; V4.1 runs it and reports it (--stats-json 'speculation')."""
    import json

    from click.testing import CliRunner

    from dsv4stream.cli.run import run as run_cmd

    def run(*args: str):
        return CliRunner().invoke(run_cmd, [*args, "--budget", "1", "--threads", "1"])

    r = run(str(tiny_v4), "--prompt-ids", "1,2", "--speculate", "3")
    assert isinstance(r.exception, UsageError) and "--speculate 3: this checkpoint cannot draft" in str(r.exception)
    r = run(str(FIXTURE), "--prompt-ids", "1,2", "--speculate", "fast")
    assert isinstance(r.exception, UsageError) and "--speculate 'fast'" in str(r.exception)
    r = run(str(FIXTURE), "--prompt-ids", "1,2", "--speculate", "6")
    assert isinstance(r.exception, UsageError) and "at most 5" in str(r.exception)
    out = tmp_path / "s.json"
    r = run(str(FIXTURE), "--prompt-ids", ",".join(map(str, prompt())), "-n", "8", "--speculate", "2",
            "--stats-json", str(out))  # fmt: skip
    assert r.exit_code == 0, r.output
    spec = json.loads(out.read_text())["speculation"]
    assert spec["setting"] == "2" and spec["tokens"] == 7 and spec["verified_tokens"] >= spec["drafted_tokens"]
    assert "speculate" in r.stderr and "mean accepted length" in r.stderr
