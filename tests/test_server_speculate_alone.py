"""`--speculate auto` under a batching server (issue 41): a lone request drafts where drafting pays.

A batching worker (--max-batch 4) on a generated V4.1 checkpoint, its drafter replaced by a
STAND-IN that proposes the request's own greedy continuation (every draft right, as the bench's
stand-ins; the checkpoint's random drafter accepts nothing, so no served drafter could show it):
one greedy request with `speculate: auto`, alone, verifies drafts (auto's own decision, from the
costs it measured) and gives `off`'s ids. Fails where a batching server's lone request decodes in
batched passes, which never draft.
"""

from __future__ import annotations

import threading

from test_server_speculate import tok  # noqa: F401  (the release tokenizer fixture)

from dsv4stream.engine.speculate_v41 import ScriptedDrafter
from dsv4stream.run import planner
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.server.cache import StateCache
from dsv4stream.server.reply import ReplyStream
from dsv4stream.server.worker import Job, Worker
from dsv4stream.text.sampler import SamplingParams

GB = 10**9
CTX = 256
GEN = 96
PROMPT = [5, 17, 99, 5, 17, 200, 3, 44]


def ask(worker: Worker, tok, speculate) -> list[int]:  # noqa: F811
    done, errors, got = threading.Event(), [], []

    class Logged(ReplyStream):
        def push(self, token_id: int):
            got.append(token_id)
            return super().push(token_id)

    def emit(kind: str, payload: object) -> None:
        if kind == "error":
            errors.append(payload)
        if kind in ("done", "error"):
            done.set()

    reply = Logged(tok, thinking=False, tools=False, eos=-1)  # no stop before GEN tokens
    worker.submit(Job(list(PROMPT), GEN, SamplingParams(0.0), reply, emit, speculate=speculate))
    assert done.wait(600) and not errors, errors
    return got


def test_a_lone_request_drafts_under_auto_where_it_pays(tiny_v41, tok, monkeypatch) -> None:  # noqa: F811
    with Runtime.open(tiny_v41, RunOptions(budget=GB, io="buffered", ctx=CTX, threads=1)) as rt:
        ram = StateCache(4 * planner.state_bytes_for(rt.cfg, CTX))
        w = Worker(rt, rt.cfg.vocab_size, ram, None, lambda _: None, [], tok.decode, tok.special.user, max_batch=4)
        try:
            assert w.batched
            off = ask(w, tok, "off")
            full = [*PROMPT, *off]

            def propose(pos: int, token: int, k: int) -> list[int]:
                return full[pos + 2 : pos + 2 + k]

            block = rt.cfg.dspark.block_size
            monkeypatch.setattr(rt.speculator, "drafter", lambda session: ScriptedDrafter(propose, block))
            before = w.stats.speculation()
            assert before is None or before.verify_passes == 0
            assert ask(w, tok, "auto") == off
            spec = w.stats.speculation()
        finally:
            w.close()
    assert spec is not None and spec.setting == "auto"
    assert spec.verify_passes > 0 and spec.accepted == spec.drafted, spec.as_dict()
