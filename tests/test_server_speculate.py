"""A request's `speculate` field (issue 41): a wrong type is a 400 naming it on every endpoint
that reads it, a draft length the checkpoint cannot run is a 400, and the worker's generations
give the same ids (sampled, with a seed, both choices of `n` = 2) with drafts or without."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from dsv4stream.run import planner
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.server.app import create_app
from dsv4stream.server.cache import StateCache
from dsv4stream.server.reply import ReplyStream
from dsv4stream.server.toolkit import ServerState
from dsv4stream.server.worker import Job, Worker
from dsv4stream.text import chat
from dsv4stream.text.sampler import SamplingParams
from dsv4stream.text.tokenizer import Tokenizer
from dsv4stream.text.vocab import write_tokenizer_files

GB = 10**9
CTX = 256
MSG = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/chat/completions": {"messages": MSG},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
    "/v1/messages": {"messages": MSG, "max_tokens": 4},
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """The release's V4.1 tokenizer (the worker decodes the tiny checkpoint's ids < 512 with it)."""
    d = tmp_path_factory.mktemp("v41tok")
    write_tokenizer_files(d, "v41")
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "text_config": {"vocab_size": 129280}}))
    return Tokenizer.from_checkpoint(d)


@pytest.fixture(scope="module")
def rt(tiny_v41):
    """A run on a generated V4.1 checkpoint with its DSpark drafter."""
    with Runtime.open(tiny_v41, RunOptions(budget=GB, io="buffered", ctx=CTX, threads=1)) as rt:
        yield rt


@pytest.mark.parametrize("path", BODIES)
def test_a_wrong_speculate_is_a_400_naming_it(tok, rt, path) -> None:
    srv = ServerState("tiny", tok, CTX, lambda line: None, chat.encoder_for(rt.cfg.layout, rt.cfg.family))
    srv.worker = SimpleNamespace(
        queued=0, rt=rt, submit=lambda job: pytest.fail("a refused request reached the engine")
    )
    with TestClient(create_app(srv)) as c:
        for bad in ([2], 1.5, True, "fast", -1, {"n": 2}, 99):
            r = c.post(path, json={**BODIES[path], "speculate": bad})
            assert r.status_code == 400, (path, bad, r.text)
            err = r.json()["error"]
            assert "speculate" in err["message"] and err.get("param", "speculate") == "speculate", err


def test_a_draft_length_without_a_drafter_is_a_400(tok, tiny_v4) -> None:
    with Runtime.open(tiny_v4, RunOptions(budget=GB, io="buffered", ctx=CTX, threads=1)) as v4:
        assert v4.speculator.resolve("auto", "speculate") == "off"
        srv = ServerState("tiny", tok, CTX, lambda line: None, chat.encoder_for("dspark-v41", "v41"))
        srv.worker = SimpleNamespace(queued=0, rt=v4, submit=lambda job: pytest.fail("reached the engine"))
        with TestClient(create_app(srv)) as c:
            r = c.post("/v1/chat/completions", json={"messages": MSG, "speculate": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculate"
    assert "cannot draft" in r.json()["error"]["message"]


def generate(worker: Worker, tok: Tokenizer, ids: list[int], speculate) -> list[list[int]]:
    done, errors, got = threading.Event(), [], {0: [], 1: []}

    class Logged(ReplyStream):
        def __init__(self, i: int) -> None:
            super().__init__(tok, thinking=False, tools=False)
            self.i = i

        def push(self, token_id: int):
            got[self.i].append(token_id)
            return super().push(token_id)

    def emit(kind: str, payload: object) -> None:
        if kind == "error":
            errors.append(payload)
        if kind in ("done", "error"):
            done.set()

    job = Job(ids, 20, SamplingParams(1.0, seed=11), Logged(0), emit, more_replies=[Logged(1)], speculate=speculate)
    worker.submit(job)
    assert done.wait(600) and not errors, errors
    return [got[0], got[1]]


def test_the_worker_gives_the_same_sampled_ids_whatever_speculate(rt, tok) -> None:
    ram = StateCache(4 * planner.state_bytes_for(rt.cfg, CTX))
    w = Worker(rt, rt.cfg.vocab_size, ram, None, lambda _: None, [], tok.decode, tok.special.user)
    try:
        ids = [5, 17, 99, 5, 17, 200, 3, 44]
        off = generate(w, tok, ids, "off")
        assert generate(w, tok, ids, 2) == off and generate(w, tok, ids, "auto") == off
        assert off[0] != off[1]  # the two choices draw differently
    finally:
        w.close()
    spec = rt.stats().phases.speculation
    assert spec is not None and spec.drafted > 0
