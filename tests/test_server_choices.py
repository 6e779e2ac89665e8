"""`n` > 1 choices in the engine thread: every choice goes through `Runtime.generate` as the
first does, so its decode steps are in the run's figures and each token it picks has its
hash-layer experts asked for before the reply handles it. An in-process `Worker` over a
`Runtime` on the tiny random-weight checkpoint (no HTTP: the figures are the runtime's)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dsv4stream import synth
from dsv4stream.run import planner
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.server.cache import StateCache
from dsv4stream.server.reply import ReplyStream
from dsv4stream.server.worker import Job, Worker
from dsv4stream.text import chat
from dsv4stream.text.sampler import SamplingParams, banned_ids
from dsv4stream.text.tokenizer import Tokenizer

GB = 10**9
CTX = 256


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("choices") / "tiny"
    return synth.make_checkpoint(out, preset="tiny", seed=5, vocab_size=synth.REAL_VOCAB, tokenizer=True)


@pytest.fixture(scope="module")
def tok(ckpt) -> Tokenizer:
    return Tokenizer.from_checkpoint(ckpt)


@pytest.fixture
def worker(ckpt, tok):
    with Runtime.open(ckpt, RunOptions(budget=GB, io="buffered", ctx=CTX, threads=1)) as rt:
        ram = StateCache(4 * planner.state_bytes_for(rt.cfg, CTX))
        w = Worker(rt, tok.n_tokens, ram, None, lambda _: None, banned_ids(tok), tok.decode, tok.special.user)
        yield w
        w.close()


class LoggedReply(ReplyStream):
    """A reply that writes each token it is handed to a shared log, tagged with its choice."""

    def __init__(self, tok: Tokenizer, log: list, index: int) -> None:
        super().__init__(tok, thinking=False, tools=False)
        self.log, self.index = log, index

    def push(self, token_id: int):
        self.log.append(("push", self.index, token_id))
        return super().push(token_id)


def run(worker: Worker, tok: Tokenizer, n: int, log: list | None = None) -> Job:
    ids = tok.encode(chat.render(chat.one_turn("Name three colours.", "You are terse."), "chat"))
    replies = [LoggedReply(tok, log if log is not None else [], i) for i in range(n)]
    done = threading.Event()
    errors: list = []

    def emit(kind: str, payload: object) -> None:
        if kind == "error":
            errors.append(payload)
        if kind in ("done", "error"):
            done.set()

    job = Job(ids, 6, SamplingParams(1.0, seed=3), replies[0], emit, more_replies=replies[1:])
    worker.submit(job)
    assert done.wait(600) and not errors, errors
    return job


def test_every_choice_is_in_the_runs_figures(worker, tok) -> None:
    before = worker.rt.stats()
    job = run(worker, tok, n=3)
    after = worker.rt.stats()
    # each choice's first token comes from logits already there (the prefill's); the others from a step
    steps = job.usage.completion_tokens - 3
    assert after.decode_tokens - before.decode_tokens == steps > 0
    assert len(after.stop_reasons) - len(before.stop_reasons) == 3
    assert len(after.turn_prompt_tokens) - len(before.turn_prompt_tokens) == 1  # one prompt, read once
    assert len(after.first_token_seconds) - len(before.first_token_seconds) == 1
    assert len(after.generated_ids) - len(before.generated_ids) == job.usage.completion_tokens


def test_a_requests_times_are_its_first_token_and_the_wall_time_after_it(worker, tok) -> None:
    """Prefill: to the first choice's first token as its session timed it; decode: the wall time
    from there to the last choice's end (the choices may decode together)."""
    t0 = time.perf_counter()
    u = run(worker, tok, n=2).usage
    wall = time.perf_counter() - t0
    assert u.prefill_seconds == worker.rt.stats().first_token_seconds[-1] > 0
    assert 0 < u.decode_seconds and u.seconds < wall


def test_every_choice_prefetches_a_picked_tokens_hash_layer_experts_before_handing_it_on(worker, tok) -> None:
    rt, log = worker.rt, []
    asked = rt.engine.experts.prefetch
    hash_layers = range(min(rt.cfg.num_hash_layers, rt.cfg.n_layers))
    assert len(hash_layers) > 0

    def logged_prefetch(keys) -> None:
        log.append(("prefetch", sorted(keys)))
        asked(keys)

    rt.engine.experts.prefetch = logged_prefetch
    run(worker, tok, n=3, log=log)

    def hash_keys(t: int) -> list:
        return sorted((i, int(e)) for i in hash_layers for e in np.unique(rt.engine.trunk.tid2eid(i)[[t]]))

    pushes = [k for k, ev in enumerate(log) if ev[0] == "push"]
    for choice in (0, 1, 2):
        mine = [k for k in pushes if log[k][1] == choice]
        assert len(mine) >= 2
        for k in mine[:-1]:  # the last token of a choice is never fed: nothing to prefetch for it
            assert log[k - 1] == ("prefetch", hash_keys(log[k][2])), (choice, log[k - 4 : k + 1])
