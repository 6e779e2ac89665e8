"""The server's batch reads prompts that arrive together in shared passes (`server.batching.Batch`).

Requests written as the worker writes them (a coroutine yielding each prompt segment as a
`Prompt`, then each token as a `Step`) join one `Batch`: their prompts' segments go in the same
passes, beside the decode steps of the requests already running, and each request's logits are
bit for bit those of a twin session that read the same prompt and tokens alone. A pass holds at
most a prefill segment's tokens (`joined_passes`), and a request dropped while it waits for its
prompt's next segment leaves the others' logits unchanged.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from dsv4stream.engine.batch import Feed
from dsv4stream.engine.session import segment_cuts
from dsv4stream.server import batching
from dsv4stream.server.batching import Batch, Prompt, Step, joined_passes

SEGMENT = 8
STEPS = 3


def _session(engine):
    return engine.session(chunk_size=4, segment=SEGMENT)


def _request(session, prompt: list[int], out: list):
    """A request as `Worker._serve` runs one: its prompt in segments, then STEPS greedy tokens."""
    cuts = segment_cuts(len(prompt), SEGMENT, [len(prompt) - 1])
    logits = None
    for a, b in zip([0, *cuts[:-1]], cuts, strict=True):
        got = yield Prompt(session, np.asarray(prompt[a:b]), b == len(prompt))
        if got is None:
            raise RuntimeError("dropped")
        logits = got[0]
    out.append(logits)
    for _ in range(STEPS):
        got = yield Step(session, int(np.argmax(logits)))
        if got is None:
            raise RuntimeError("dropped")
        logits = got[0]
        out.append(logits)


def _solo(engine, prompt: list[int]) -> list[np.ndarray]:
    s = _session(engine)
    out = [s.prefill(prompt, last_only=True, boundaries=[len(prompt) - 1])]
    for _ in range(STEPS):
        out.append(s.step(int(np.argmax(out[-1]))))
    return out


def _job():
    return SimpleNamespace(cancelled=threading.Event())


def _run(family, monkeypatch, numerics="fast", drop=None):
    engine = family.engine(numerics)
    prompts = [[int(t) for t in family.ids(n, seed=30 + n)] for n in (4, 6, 13)]
    outs: list[list] = [[] for _ in prompts]
    jobs = [_job() for _ in prompts]
    ended: dict[int, BaseException | None] = {}
    passes: list[list[Feed]] = []
    real = batching.forward_governed

    def counted(feeds):
        passes.append(list(feeds))
        return real(feeds)

    monkeypatch.setattr(batching, "forward_governed", counted)
    k_of = {id(j): k for k, j in enumerate(jobs)}
    batch = Batch(
        lambda job: _request(_session(engine), prompts[k_of[id(job)]], outs[k_of[id(job)]]),
        lambda _jobs: None,
        lambda job, err: ended.__setitem__(k_of[id(job)], err),
    )
    for j in jobs:  # they arrive together: each waits for its first segment
        batch.start(j)
    n = 0
    while batch.rows:
        if drop is not None and n == 1:
            jobs[drop].cancelled.set()
        batch.step()
        n += 1
    return engine, prompts, outs, ended, passes


@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_prompts_arriving_together_share_passes_and_keep_their_bits(family, monkeypatch, numerics) -> None:
    engine, prompts, outs, ended, passes = _run(family, monkeypatch, numerics)
    assert ended == {0: None, 1: None, 2: None}
    for k, p in enumerate(prompts):
        want = _solo(engine, p)
        assert len(outs[k]) == len(want)
        for a, b in zip(outs[k], want, strict=True):
            assert np.array_equal(a, b), f"request {k} ({numerics})"
    # the first step read two prompts' first segments together (3 + 5 tokens), the third's 8 in a
    # pass of its own (the cap); the next one every prompt's next segment in one pass
    assert [[f.ids.size for f in feeds] for feeds in passes[:3]] == [[3, 5], [8], [1, 1, 4]]
    # a later pass carried a prompt's segment beside another's decode step
    assert any(
        {f.logits for f in feeds} >= {"all", "none"} or {f.logits for f in feeds} >= {"all", "last"} for feeds in passes
    )
    assert all(sum(f.ids.size for f in feeds) <= SEGMENT for feeds in passes)


def test_a_request_dropped_while_its_prompt_waits_leaves_the_others_unchanged(family, monkeypatch) -> None:
    engine, prompts, outs, ended, _ = _run(family, monkeypatch, drop=2)
    assert ended[0] is None and ended[1] is None and isinstance(ended[2], RuntimeError)
    for k in (0, 1):
        for a, b in zip(outs[k], _solo(engine, prompts[k]), strict=True):
            assert np.array_equal(a, b)


def test_a_pass_holds_at_most_a_segment_of_tokens(family) -> None:
    engine = family.engine("exact")
    s = [_session(engine) for _ in range(5)]
    feeds = [
        Feed(s[0], np.asarray([1])),
        Feed(s[1], np.arange(4), "none"),
        Feed(s[2], np.asarray([2])),
        Feed(s[3], np.arange(5), "last"),
        Feed(s[4], np.arange(6), "none"),
    ]
    # the decode steps first (2 rows), the 4- and 5-token segments beyond 8 tokens: a pass each
    assert joined_passes(feeds) == [[0, 2, 1], [3], [4]]
    assert joined_passes(feeds[:1]) == [[0]]
    assert joined_passes([feeds[1], feeds[3]]) == [[0], [1]]
    assert joined_passes([feeds[1], feeds[0], feeds[2]]) == [[1, 2, 0]]
    assert joined_passes([Feed(s[1], np.arange(2), "none"), Feed(s[3], np.arange(3), "last")]) == [[0, 1]]
