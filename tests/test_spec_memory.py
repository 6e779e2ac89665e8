"""`--speculate auto`'s memory between runs (`engine.spec_memory`, `AutoDrafts.remembered`).

The policy side runs on `test_spec_policy.simulate`'s machine: a run that starts from what an
earlier run measured pays nothing to learn a drafter that never pays, drafts early where it did,
and a memory that does not hold for this prompt costs what a first run's lesson costs. The file
side: what is written is read back, and no bad file (garbage, values out of range, a FIFO, a
symbolic link, a folder that cannot be written) stops a run or is written through.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from test_spec_policy import BLOCK, CONCAVE_RAM, RAM, simulate

from dsv4stream.engine.spec_memory import SpecMemory, memory_key, parse
from dsv4stream.engine.spec_policy import AutoDrafts, Remembered
from dsv4stream.run import planner
from dsv4stream.run.memory import measure
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime

FIXTURE = Path(__file__).parent / "fixtures" / "v41" / "dspark"


def learned(p: float, costs: dict, n: int = 128, seed: int = 0, remembered: Remembered | None = None) -> Remembered:
    policy = AutoDrafts(BLOCK, remembered)
    simulate(policy, n, p, seed=seed, **costs)
    rec = policy.remember()
    assert rec is not None
    return rec


@pytest.mark.parametrize("costs", [RAM, CONCAVE_RAM], ids=["ram", "concave"])
@pytest.mark.parametrize("draft", [0.6, 0.9])
def test_a_drafter_remembered_to_accept_nothing_is_not_run_again(costs, draft) -> None:
    """A first run pays one drafter run to learn that nothing is accepted (test_spec_policy); a
    run that remembers it runs the drafter not once in a 128-token reply: exactly off's time."""
    c = dict(costs, draft=draft)
    rec = learned(0.0, c)
    assert rec.draft_share == pytest.approx(draft, rel=0.05) and rec.accepted == 0 and rec.rejected >= 1
    for seed in range(8):
        speed, runs, verified = simulate(AutoDrafts(BLOCK, rec), 128, 0.0, seed=seed, **c)
        assert (runs, verified) == (0, 0) and speed == pytest.approx(1.0), seed
    # a long run still looks again now and then, within SHARE of the time
    speed, runs, _ = simulate(AutoDrafts(BLOCK, rec), 4000, 0.0, **c)
    assert runs >= 1 and speed >= 0.995


class Lengths(AutoDrafts):
    """AutoDrafts keeping the length of every pass it is told of."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.lengths: list[int] = []

    def passed(self, n: int, seconds: float, read_bytes: int, read_seconds: float) -> None:
        self.lengths.append(n)
        super().passed(n, seconds, read_bytes, read_seconds)


@pytest.mark.parametrize("p", [0.9, 0.97])
def test_a_drafter_remembered_to_pay_drafts_from_the_start(p) -> None:
    """90-97 % right in RAM: a run that remembers it checks with a watch of one draft and verifies
    drafts from the next cycles (a first run watches one draft, then two, ... first); over 16
    replies it gains at least as much as first runs do."""
    rec = learned(p, RAM, n=400, seed=1)
    assert rec.accepted / (rec.accepted + rec.rejected) > 0.8
    fresh, kept, early = [], [], 0
    for seed in range(16):
        first = Lengths(BLOCK)
        fresh.append(simulate(first, 128, p, seed=seed, **RAM)[0])
        policy = Lengths(BLOCK, rec)
        kept.append(simulate(policy, 128, p, seed=seed, **RAM)[0])
        # (where the checking draft is wrong, 3-10 % of replies here, the memory is dropped)
        early += next((i for i, n in enumerate(policy.lengths) if n > 1), 1 << 30) <= 3
    assert early >= 12, early
    assert sum(kept) / len(kept) >= 0.995 * sum(fresh) / len(fresh) and sum(kept) / len(kept) > 1.15, (kept, fresh)


@pytest.mark.parametrize("costs", [RAM, CONCAVE_RAM], ids=["ram", "concave"])
def test_a_memory_that_does_not_hold_costs_one_drafter_run(costs) -> None:
    """Remembered 90 % right, this prompt 0 %: the one watch that checks the memory finds its
    first draft wrong and drops it, so the reply loses one drafter run, as a first run does."""
    rec = learned(0.9, costs, n=400, seed=1)
    for seed in range(8):
        speed, runs, verified = simulate(AutoDrafts(BLOCK, rec), 128, 0.0, seed=seed, **costs)
        assert (runs, verified) == (1, 0), (seed, runs, verified)
        assert speed >= 1 - 1.05 * costs["draft"] / 127, speed


def test_what_a_run_remembers_adds_to_what_it_was_given() -> None:
    """A run that counted no draft keeps the remembered acceptance; one that did keeps its own
    counts, which started from the remembered ones (a prior of at most 8 drafts)."""
    rec = learned(0.0, RAM)
    again = learned(0.0, RAM, remembered=rec)  # drafter never run: the same figures, one more run
    assert (again.draft_share, again.accepted, again.rejected, again.runs) == (
        rec.draft_share, rec.accepted, rec.rejected, rec.runs + 1,
    )  # fmt: skip
    good = learned(0.9, RAM, n=400)
    assert good.accepted + good.rejected > 8
    policy = AutoDrafts(BLOCK, good)
    assert policy.accepted + policy.rejected == pytest.approx(8.0)
    assert policy.alpha == pytest.approx(good.accepted / (good.accepted + good.rejected))


# ---- the file ---------------------------------------------------------------------------------


def test_saved_figures_are_read_back(tmp_path) -> None:
    rec = Remembered(0.72, 3.5, 1.25, 0.6, 4)
    m = SpecMemory(tmp_path / "a" / "k.json")
    assert m.load() is None  # nothing yet, no warning
    m.save(rec)
    assert SpecMemory(tmp_path / "a" / "k.json").load() == rec
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no temp file left


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "\xff\xfe",
        "[]",
        '{"version": 1}',
        '{"version": 2, "draft_share": 0.5, "accepted": 1, "rejected": 1, "confidence": null, "runs": 1}',
        '{"version": 1, "draft_share": -0.5, "accepted": 1, "rejected": 1, "confidence": null, "runs": 1}',
        '{"version": 1, "draft_share": NaN, "accepted": 1, "rejected": 1, "confidence": null, "runs": 1}',
        '{"version": 1, "draft_share": 0.5, "accepted": true, "rejected": 1, "confidence": null, "runs": 1}',
        '{"version": 1, "draft_share": 0.5, "accepted": "3", "rejected": 1, "confidence": null, "runs": 1}',
        '{"version": 1, "draft_share": 0.5, "accepted": 1, "rejected": 1, "confidence": 7, "runs": 1}',
        '{"version": 1, "draft_share": 0.5, "accepted": 1, "rejected": 1, "confidence": null, "runs": 0}',
        '{"version": 1, "draft_share": 1e308, "accepted": 1, "rejected": 1, "confidence": null, "runs": 1}',
    ],
)
def test_a_bad_file_is_ignored_with_one_warning_and_replaced(tmp_path, text) -> None:
    path = tmp_path / "k.json"
    path.write_bytes(text.encode("latin-1"))
    said: list[str] = []
    m = SpecMemory(path, said.append)
    assert m.load() is None and m.load() is None
    assert len(said) == 1 and str(path) in said[0] and "learning afresh" in said[0]
    m.save(Remembered(0.5, 1.0, 2.0))
    assert parse(json.loads(path.read_text())) == Remembered(0.5, 1.0, 2.0)


def test_a_fifo_is_not_read_nor_written_over(tmp_path) -> None:
    path = tmp_path / "k.json"
    os.mkfifo(path)
    said: list[str] = []
    m = SpecMemory(path, said.append)
    assert m.load() is None  # returns at once: no writer ever opens the FIFO
    m.save(Remembered(0.5, 1.0, 2.0))
    assert stat.S_ISFIFO(os.lstat(path).st_mode) and len(said) == 2


def test_a_symbolic_link_is_not_written_through(tmp_path) -> None:
    theirs = tmp_path / "theirs.txt"
    theirs.write_text("not ours\n")
    path = tmp_path / "k.json"
    path.symlink_to(theirs)
    said: list[str] = []
    m = SpecMemory(path, said.append)
    assert m.load() is None
    m.save(Remembered(0.5, 1.0, 2.0))
    assert theirs.read_text() == "not ours\n" and path.is_symlink() and said


def test_a_folder_that_cannot_be_written_costs_only_the_memory(tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who writes anywhere")
        said: list[str] = []
        m = SpecMemory(ro / "speculation" / "k.json", said.append)
        m.save(Remembered(0.5, 1.0, 2.0))
        m.save(Remembered(0.5, 1.0, 2.0))
        assert len(said) == 1 and "cannot keep" in said[0]
    finally:
        ro.chmod(0o700)


def test_the_key_separates_what_the_figures_hold_for() -> None:
    base = {"checkpoint": "abc", "numerics": "fast", "resident": "all", "threads": 2, "cpu": "x"}
    keys = {memory_key(base)}
    for k, v in (("checkpoint", "abd"), ("numerics", "exact"), ("resident", "40%"), ("threads", 1), ("cpu", "y")):
        keys.add(memory_key({**base, k: v}))
    assert len(keys) == 6 and memory_key(dict(reversed(list(base.items())))) == memory_key(base)


def test_off_turns_the_memory_off(monkeypatch) -> None:
    monkeypatch.setenv("DSV4_SPECULATE_MEMORY", "off")
    assert SpecMemory.for_run({"checkpoint": "a"}) is None
    monkeypatch.setenv("DSV4_SPECULATE_MEMORY", "on")
    assert SpecMemory.for_run({"checkpoint": "a"}) is not None


# ---- a run --------------------------------------------------------------------------------------


def test_a_run_starts_from_what_the_last_run_measured(tmp_path, monkeypatch) -> None:
    """Two runs of the same checkpoint and options: the first writes what its auto policy
    measured, the second's policy starts from it; a run with other options (threads) does not.
    Ids equal off's throughout."""
    monkeypatch.setenv("DSV4_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("DSV4_SPECULATE_MEMORY", "on")
    with np.load(FIXTURE / "draft.npz") as z:
        prompt = [int(i) for i in z["token_ids"][:8]]
    n = measure(FIXTURE, RunOptions(budget=1))
    opts = RunOptions(budget=planner.budget_for(n, n.total_experts), threads=1)
    with Runtime.open(FIXTURE, opts) as rt:
        off = list(rt.generate(rt.session(), prompt, 24, speculate="off"))
        assert not (tmp_path / "speculation").exists()  # off measures nothing for auto
        assert list(rt.generate(rt.session(), prompt, 24, speculate="auto")) == off
        assert rt.speculator._auto.remembered is None
    files = list((tmp_path / "speculation").glob("*.json"))
    assert len(files) == 1
    first = SpecMemory(files[0]).load()
    # (its one drafter run was the process's first: charged, not remembered as the cost)
    assert first is not None and first.runs == 1 and first.accepted + first.rejected > 0
    with Runtime.open(FIXTURE, opts) as rt:
        assert list(rt.generate(rt.session(), prompt, 24, speculate="auto")) == off
        assert rt.speculator._auto.remembered == first
    assert SpecMemory(files[0]).load().runs == 2
    with Runtime.open(FIXTURE, RunOptions(budget=opts.budget, threads=2)) as rt:
        assert list(rt.generate(rt.session(), prompt, 24, speculate="auto")) == off
        assert rt.speculator._auto.remembered is None
    assert len(list((tmp_path / "speculation").glob("*.json"))) == 2


def test_budgets_that_plan_the_same_residency_share_the_memory(tmp_path, monkeypatch) -> None:
    """`--budget` defaults to a share of the memory available at the start, which moves between
    runs: two budgets whose plans keep the same layers and expert cache share one file (before,
    the key held the budget to 0.1 GB, and a default-budget run seldom found its memory); a
    budget that streams experts has its own."""
    monkeypatch.setenv("DSV4_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("DSV4_SPECULATE_MEMORY", "on")
    with np.load(FIXTURE / "draft.npz") as z:
        prompt = [int(i) for i in z["token_ids"][:8]]
    n = measure(FIXTURE, RunOptions(budget=1))
    ram = planner.budget_for(n, n.total_experts)
    for budget in (ram, ram + 3 * 10**8, planner.budget_for(n, n.working_set)):
        with Runtime.open(FIXTURE, RunOptions(budget=budget, threads=1)) as rt:
            list(rt.generate(rt.session(), prompt, 12, speculate="auto"))
    files = sorted((tmp_path / "speculation").glob("*.json"))
    assert len(files) == 2
    assert sorted(SpecMemory(f).load().runs for f in files) == [1, 2]


def test_a_process_first_drafter_run_is_charged_not_taken_as_the_cost() -> None:
    """The first drafter run of a process warms kernels, caches and expert reads (6x a later run
    in a `dsv4 run` on a loaded machine): charged to the ledger, an upper bound of the cost while
    nothing else is timed, never the remembered cost (else a good drafter would look too dear to
    watch in every later run)."""
    policy = AutoDrafts(BLOCK)
    policy.passed(1, 1.0, 0, 0.0)
    policy.drafted(6.0, cold=True)
    policy.watched(1, 1, [0.0])
    assert policy.elapsed == 7.0 and policy._run_cost() == 6.0
    rec = policy.remember()
    assert rec is not None and rec.draft_share is None and rec.accepted == 1
    policy.drafted(0.6)
    assert policy._run_cost() == pytest.approx(0.6) and policy.remember().draft_share == pytest.approx(0.6)
    # the next run starts from the counts, and times the drafter itself
    nxt = AutoDrafts(BLOCK, rec)
    nxt.passed(1, 1.0, 0, 0.0)
    assert nxt._run_cost() is None and nxt.accepted == 1
    path_rec = parse(json.loads(json.dumps({"version": 1, **rec.__dict__})))
    assert path_rec == rec
