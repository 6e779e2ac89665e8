"""Where the experts stream, a server decodes together only the requests whose routed experts the
expert slots hold (`batching.rows_that_fit`): past that, every batched pass evicts what the next
one would hit, and the batch loses to the same requests one after another. Plans of a generated
checkpoint at budgets around that line, and a `Worker` that lowers `--max-batch` and says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4stream import synth
from dsv4stream.run import planner
from dsv4stream.run.memory import needs_of
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.server.batching import rows_that_fit
from dsv4stream.server.cache import StateCache
from dsv4stream.server.worker import Worker

CTX = 256


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fit") / "tiny"
    return synth.make_checkpoint(out, preset="tiny", seed=2, n_routed_experts=32)


def test_the_batch_holds_as_many_requests_as_the_slots_hold_working_sets(ckpt) -> None:
    needs, _ = needs_of(ckpt, CTX)
    ws = needs.working_set
    assert needs.total_experts >= 4 * ws  # room for batches of 1..3 below "every expert fits"
    for want in (1, 2, 3):
        p = planner.plan(needs, planner.budget_for(needs, want * ws + ws // 2))
        assert p.expert_slots < needs.total_experts
        got = rows_that_fit(p, 8)
        assert got * ws <= p.prefill_slots(got) < (got + 1) * ws, (want, p.expert_slots)
        assert got == want
        assert rows_that_fit(p, 1) == 1
    p = planner.plan(needs, planner.minimum_budget(needs))
    assert 1 <= rows_that_fit(p, 8) <= max(1, p.expert_slots // ws)
    p = planner.plan(needs, planner.budget_for(needs, needs.total_experts))  # nothing streams
    assert rows_that_fit(p, 8) == 8 and rows_that_fit(p, 3) == 3


def test_a_streaming_worker_lowers_its_batch_and_says_why(ckpt) -> None:
    needs, _ = needs_of(ckpt, CTX)
    budget = planner.budget_for(needs, needs.working_set + 1)  # one request's experts: a batch of 1
    logged: list[str] = []
    with Runtime.open(ckpt, RunOptions(budget=budget, io="buffered", ctx=CTX, threads=1)) as rt:
        w = Worker(rt, rt.cfg.vocab_size, StateCache(1 << 20), None, logged.append, max_batch=4)
        try:
            assert w.max_batch == rows_that_fit(rt.plan, 4) == 1
            assert any("decoding at most 1 request(s) together, not 4" in line for line in logged), logged
            assert w.batched  # still a batching server (planned without a drafter): it does not draft
        finally:
            w.close()
