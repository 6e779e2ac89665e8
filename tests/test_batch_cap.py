"""Eight clients at once on a server whose experts stream: the batch is capped where the expert
slots hold the requests' working sets (`batching.rows_that_fit`), the worker says so, no pass ever
carries more rows than the cap while eight requests wait and run, the plan stays inside the
budget, and every request gets the ids it gets served one after another (`--max-batch 1`).

The budget is set for two working sets and a half, so the cap is 2 of the 8 asked. Peak RSS read
from outside is the bench's (`bench/batching.py`); here the plan's total is held to the budget."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from test_server_choices_batch import IdsReply  # a reply that keeps the ids it is handed

from dsv4stream import synth
from dsv4stream.run import planner
from dsv4stream.run.memory import needs_of
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.server.batching import rows_that_fit
from dsv4stream.server.cache import StateCache
from dsv4stream.server.decoding import Controls
from dsv4stream.server.worker import Job, Worker
from dsv4stream.text import chat
from dsv4stream.text.sampler import SamplingParams, banned_ids
from dsv4stream.text.tokenizer import Tokenizer

CTX = 256
CLIENTS = 8
N = 6  # tokens per request


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    # experts large beside the real-vocabulary head, so a budget step is a few expert slots
    out = tmp_path_factory.mktemp("cap") / "tiny"
    return synth.make_checkpoint(
        out,
        preset="tiny",
        seed=3,
        n_routed_experts=32,
        moe_intermediate_size=2048,
        vocab_size=synth.REAL_VOCAB,
        tokenizer=True,
    )


def serve_all(
    rt, tok, max_batch: int, rows: list[int], logged: list[str], clients: int = CLIENTS, n: int = N,
    gap: float = 0.0, jobs: list | None = None,
) -> list[list[int]]:  # fmt: skip
    """`clients` requests of `n` tokens submitted at once to a fresh worker (`gap` seconds apart):
    each one's ids; `rows` gets each pass's row count, `logged` the worker's log lines, `jobs` the
    jobs (tests/test_worker_prompts.py)."""
    w = Worker(rt, tok.n_tokens, StateCache(4 * planner.state_bytes_for(rt.cfg, CTX)), None, logged.append,
               banned_ids(tok), tok.decode, tok.special.user, max_batch=max_batch)  # fmt: skip
    passed = w.batch.passed
    w.batch.passed = lambda jobs: (rows.append(len(jobs)), passed(jobs))[1]
    try:
        replies = [IdsReply(tok) for _ in range(clients)]
        done = [threading.Event() for _ in range(clients)]
        errors: list = []
        jobs = [] if jobs is None else jobs
        for k in range(clients):

            def emit(kind: str, payload: object, k=k) -> None:
                if kind == "error":
                    errors.append(payload)
                if kind in ("done", "error"):
                    done[k].set()

            ids = tok.encode(chat.render(chat.one_turn(f"Request {k}: say something.", None), "chat"))
            controls = Controls(bias={tok.special.eos: -100.0})  # each runs its N tokens
            jobs.append(Job(ids, n, SamplingParams(0.0), replies[k], emit, controls=controls))
        for job in jobs:
            w.submit(job)
            time.sleep(gap)
        assert all(d.wait(600) for d in done) and not errors, errors
        assert w.places == 0
        return [r.ids for r in replies]
    finally:
        w.close()


def test_eight_clients_at_a_streaming_budget_are_capped_and_get_their_solo_ids(ckpt) -> None:
    needs, _ = needs_of(ckpt, CTX)
    budget = planner.budget_for(needs, 2 * needs.working_set + needs.working_set // 2)
    tok = Tokenizer.from_checkpoint(ckpt)
    with Runtime.open(ckpt, RunOptions(budget=budget, io="buffered", ctx=CTX, threads=1)) as rt:
        assert rt.plan.expert_slots < needs.total_experts  # the experts stream
        assert rows_that_fit(rt.plan, CLIENTS) == 2
        assert rt.plan.planned_bytes <= budget
        alone_rows: list[int] = []
        alone = serve_all(rt, tok, 1, alone_rows, [])
        rows: list[int] = []
        logged: list[str] = []
        together = serve_all(rt, tok, CLIENTS, rows, logged)
    assert any(f"decoding at most 2 request(s) together, not {CLIENTS}" in line for line in logged), logged
    assert together == alone and all(len(ids) == N for ids in alone)
    assert len({tuple(ids) for ids in alone}) > 1  # different prompts, different answers
    assert not alone_rows  # --max-batch 1: no batched pass at all
    assert max(rows) == 2  # the cap held with eight requests in flight, and passes did carry two
    assert sum(rows) == CLIENTS * (N - 1)  # every token after a prompt's first came from a pass
