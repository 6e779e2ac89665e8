"""Prompts sent to a batching worker at once are read in the same passes (`Worker._read_prompt`).

Four requests submitted together to a fresh `Worker` (--max-batch 4, every expert in RAM), 50 ms apart:
the worker, idle, waits `GATHER` for the next after each, so its first pass reads all four
prompts; later passes carry their decode steps; each request gets the ids it gets from a worker
that serves one request at a time (`--max-batch 1`), and its prompt is counted as its prefill
(prompt tokens and time to its first token in its usage)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_batch_cap import CTX, serve_all  # requests submitted together to a fresh Worker

from dsv4stream import synth
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.server import batching, worker
from dsv4stream.text.tokenizer import Tokenizer

CLIENTS = 4
N = 5  # tokens per request


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prompts") / "tiny"
    return synth.make_checkpoint(out, preset="tiny", seed=5, vocab_size=synth.REAL_VOCAB, tokenizer=True)


def test_prompts_sent_together_are_read_in_one_pass_and_keep_their_ids(ckpt, monkeypatch) -> None:
    # requests 50 ms apart, a gather of 1 s (20 ms in the server, whose handlers queue requests
    # sent together a few ms apart): the idle worker waits for the next before its first pass
    monkeypatch.setattr(worker, "GATHER", 1.0)
    tok = Tokenizer.from_checkpoint(ckpt)
    passes: list[list[str]] = []
    real = batching.forward_governed
    monkeypatch.setattr(
        batching, "forward_governed", lambda feeds: (passes.append([f.logits for f in feeds]), real(feeds))[1]
    )
    with Runtime.open(ckpt, RunOptions(budget=int(8e9), ctx=CTX, threads=1)) as rt:
        alone = serve_all(rt, tok, 1, [], [], CLIENTS, N)
        assert not passes  # --max-batch 1: every prompt read and every token fed by its own session
        jobs: list = []
        together = serve_all(rt, tok, CLIENTS, [], [], CLIENTS, N, gap=0.05, jobs=jobs)
    assert together == alone and all(len(ids) == N for ids in alone)
    assert len({tuple(ids) for ids in alone}) > 1
    # the prompts' segments (cut where the kept states are: the last user turn's start, one token
    # short of the end) each went in a pass of all four, the last tokens together; then the
    # decode passes of four rows
    k = passes.index(["last"] * CLIENTS)
    assert k >= 1 and passes[:k] == [["none"] * CLIENTS] * k, passes[: k + 1]
    assert passes[k + 1 :] == [["all"] * CLIENTS] * (N - 1)
    for job in jobs:
        assert job.usage.prefill_seconds > 0 and job.usage.prompt_tokens == len(job.ids)
