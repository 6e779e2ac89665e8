"""`n` > 1 choices of one request decode together, as rows of the batch's passes
(`batching.choices`): each choice's ids are those of the same request on a server that decodes
one row at a time (`--max-batch 1`: the choices one after another), the passes really carry
several of its choices, and its extra choices take places of the batch (never more rows in a
pass than `max_batch`). An in-process `Worker` over a `Runtime` on the tiny checkpoint."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from dsv4stream import synth
from dsv4stream.run import planner
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.server.cache import StateCache
from dsv4stream.server.decoding import Controls
from dsv4stream.server.reply import ReplyStream
from dsv4stream.server.worker import Job, Worker
from dsv4stream.text import chat
from dsv4stream.text.sampler import SamplingParams, banned_ids
from dsv4stream.text.tokenizer import Tokenizer

GB = 10**9
CTX = 256
N = 8  # tokens per choice


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("choices_batch") / "tiny"
    return synth.make_checkpoint(out, preset="tiny", seed=5, vocab_size=synth.REAL_VOCAB, tokenizer=True)


@pytest.fixture(scope="module")
def tok(ckpt) -> Tokenizer:
    return Tokenizer.from_checkpoint(ckpt)


@pytest.fixture(scope="module")
def rt(ckpt):
    with Runtime.open(ckpt, RunOptions(budget=GB, io="buffered", ctx=CTX, threads=1)) as rt:
        yield rt


class IdsReply(ReplyStream):
    """A reply that keeps the ids it is handed."""

    def __init__(self, tok: Tokenizer) -> None:
        super().__init__(tok, thinking=False, tools=False)
        self.ids: list[int] = []

    def push(self, token_id: int):
        self.ids.append(token_id)
        return super().push(token_id)


def choices_ids(rt, tok, max_batch: int, n: int, seed: int | None, rows: list[int]) -> tuple[list[list[int]], Job]:
    """Each choice's ids for one request of n choices on a fresh worker; `rows` gets each pass's row count."""
    w = Worker(rt, tok.n_tokens, StateCache(4 * planner.state_bytes_for(rt.cfg, CTX)), None, lambda _: None,
               banned_ids(tok), tok.decode, tok.special.user, max_batch=max_batch)  # fmt: skip
    passed = w.batch.passed
    w.batch.passed = lambda jobs: (rows.append(len(jobs)), passed(jobs))[1]
    try:
        ids = tok.encode(chat.render(chat.one_turn("Name three colours.", "You are terse."), "chat"))
        replies = [IdsReply(tok) for _ in range(n)]
        done, errors = threading.Event(), []

        def emit(kind: str, payload: object) -> None:
            if kind == "error":
                errors.append(payload)
            if kind in ("done", "error"):
                done.set()

        params = SamplingParams(1.0 if seed is not None else 0.0, seed=seed)
        controls = Controls(bias={tok.special.eos: -100.0})  # every choice runs its N tokens
        job = Job(ids, N, params, replies[0], emit, controls=controls, more_replies=replies[1:])
        w.submit(job)
        assert done.wait(600) and not errors, errors
        assert w.places == 0  # every place given back
        return [r.ids for r in replies], job
    finally:
        w.close()


@pytest.mark.parametrize("seed", [11, None])
def test_choices_decode_together_with_their_one_at_a_time_ids(rt, tok, seed) -> None:
    alone_rows: list[int] = []
    alone, _ = choices_ids(rt, tok, 1, 3, seed, alone_rows)
    rows: list[int] = []
    together, job = choices_ids(rt, tok, 4, 3, seed, rows)
    assert together == alone
    assert all(len(c) == N for c in together)
    if seed is not None:
        assert len({tuple(c) for c in together}) == 3  # each choice its own seed stream
    assert not alone_rows  # --max-batch 1: each choice steps itself, one after another
    assert max(rows) == 3 and job.usage.mean_batch > 2  # the three choices shared the passes
    assert job.usage.completion_tokens == 3 * N


def test_a_requests_choices_take_places_of_the_batch(rt, tok) -> None:
    alone, _ = choices_ids(rt, tok, 1, 3, 5, [])
    rows: list[int] = []
    got, _ = choices_ids(rt, tok, 2, 3, 5, rows)
    assert got == alone
    assert max(rows) == 2  # never more rows than --max-batch: the third choice waited for a place
