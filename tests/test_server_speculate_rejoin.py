"""A batching server's request goes back to drafting once it is alone again (issue 41, `_SoloDrafts`).

A batching worker (--max-batch 4) on a generated V4.1 checkpoint, its drafter replaced by a
STAND-IN that proposes each request's own greedy continuation (every draft right: the random
drafter accepts nothing, so only a stand-in shows drafts being kept). A long request taken beside
a short one decodes in batched passes; once the short one has ended it drafts again; a third
request arriving while it drafts puts it back in batched passes, and it drafts again after that
one. Every request gets `off`'s ids; its drafting calls' counts and the passes of the batch it
shared add up to its tokens. Fails where a request that went batched never drafts again.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
from test_server_speculate import rt, tok  # noqa: F401  (the V4.1 run and the release tokenizer fixtures)

from dsv4stream.engine.session import Session
from dsv4stream.engine.spec_stats import SpecCounts
from dsv4stream.engine.speculate_v41 import ScriptedDrafter
from dsv4stream.run import planner
from dsv4stream.server.cache import StateCache
from dsv4stream.server.reply import ReplyStream
from dsv4stream.server.worker import Job, Worker
from dsv4stream.text.sampler import SamplingParams

CTX = 256
LONG, SHORT = 64, 6
PROMPTS = {"long": [5, 17, 99, 5, 17, 200, 3, 44], "short": [7, 8, 9, 10, 11], "late": [300, 301, 5, 6]}


class Request:
    """A greedy request sent to the worker; `on_token(n)` after its n-th token (on the engine thread)."""

    def __init__(
        self, worker: Worker, tokenizer, prompt, gen: int, speculate, on_token=None, n=1, seed=None, on_event=None
    ) -> None:
        self.done, self.errors, self.got = threading.Event(), [], []
        self.more: list[list[int]] = [[] for _ in range(n - 1)]  # choices 1.. (n > 1)

        class Kept(ReplyStream):
            def __init__(self, got: list[int], on_token=None) -> None:
                super().__init__(tokenizer, thinking=False, tools=False, eos=-1)  # no stop before `gen` tokens
                self.kept, self.on_token = got, on_token

            def push(self, token_id: int):
                self.kept.append(token_id)
                if self.on_token is not None:
                    self.on_token(len(self.kept))
                return super().push(token_id)

        def emit(kind: str, payload: object) -> None:
            if on_event is not None:
                on_event(kind)
            if kind == "error":
                self.errors.append(payload)
            if kind in ("done", "error"):
                self.done.set()

        reply, more = Kept(self.got, on_token), [Kept(g) for g in self.more]
        params = SamplingParams(1.0 if seed is not None else 0.0, seed=seed)
        ids = PROMPTS[prompt] if isinstance(prompt, str) else prompt
        self.job = Job(list(ids), gen, params, reply, emit, speculate=speculate, more_replies=more)
        worker.submit(self.job)

    def ids(self) -> list[int]:
        assert self.done.wait(600) and not self.errors, self.errors
        return self.got

    def choices(self) -> list[list[int]]:
        return [self.ids(), *self.more]


def worker(rt, tok, states: int = 4) -> Worker:  # noqa: F811
    ram = StateCache(states * planner.state_bytes_for(rt.cfg, CTX))
    return Worker(rt, rt.cfg.vocab_size, ram, None, lambda _: None, [], tok.decode, tok.special.user, max_batch=4)


@pytest.mark.parametrize("seed", [None, 3])
def test_a_request_left_alone_drafts_again_with_off_ids(rt, tok, monkeypatch, seed) -> None:  # noqa: F811
    """The long request greedy, or sampled with a seed (its draws keyed by position: the stand-in's
    drafts, `off`'s ids, are right either way)."""
    w = worker(rt, tok)
    try:
        off = {p: Request(w, tok, p, n, "off", seed=seed if p == "long" else None).ids()
               for p, n in (("long", LONG), ("short", SHORT), ("late", SHORT))}  # fmt: skip
        full = [*PROMPTS["long"], *off["long"]]
        cycle: list[int] = []  # tokens the long request had when each drafting cycle began

        def propose(pos: int, token: int, k: int) -> list[int]:
            cycle.append(len(long.got))
            return full[pos + 2 : pos + 2 + k]

        block = rt.cfg.dspark.block_size
        monkeypatch.setattr(rt.speculator, "drafter", lambda session: ScriptedDrafter(propose, block))
        passes = count_own_passes(monkeypatch)
        turns0 = len(rt.engine.phases.turns)
        late: list[Request] = []

        def arrive(n: int) -> None:
            # the third request, while the long one drafts again past the short one: at the second
            # token of a cycle, handed on after its verification pass, the drafts of which are fed
            if n >= LONG // 2 and cycle and n == cycle[-1] + 2 and not late:
                late.append(Request(w, tok, "late", SHORT, "off"))

        short = Request(w, tok, "short", SHORT, "off")  # taken first: the long one is taken beside it
        long = Request(w, tok, "long", LONG, 2, on_token=arrive, seed=seed)
        got = {"short": short.ids(), "long": long.ids()}
        assert late, "the long request never drafted again once the short one had ended"
        got["late"] = late[0].ids()
        spec = w.stats.speculation()
        turns = rt.engine.phases.turns[turns0:]
    finally:
        w.close()
    assert got == off
    # the long request: batched beside the short one, drafting, batched beside the late one, drafting
    drafting = [t for t in turns if t.speculation is not None]
    assert len(drafting) == 2 and len(turns) == 6, [(len(t.tokens), t.speculation) for t in turns]
    assert all(t.speculation.verify_passes > 0 for t in drafting)  # each drafting stretch verified drafts
    mine = SpecCounts.total([t.speculation for t in drafting])
    assert spec is not None and spec.as_dict() == mine.as_dict()  # the server's stats: its two calls summed
    assert spec.drafted > 0 and spec.accepted == spec.drafted, spec.as_dict()
    # every call's record summed gives its tokens; after the first, each came from one pass of the
    # batch it shared, a drafting call's first pass (the token it was handed, its one-token prompt)
    # or a drafting cycle
    u = long.job.usage
    assert sum(len(t.tokens) for t in turns) == LONG + 2 * SHORT and u.completion_tokens == LONG
    assert u.batch_passes + len(drafting) + spec.tokens == LONG - 1, (u.batch_passes, spec.as_dict())
    # and the hand-overs cost no pass: its passes outside the batch's are the drafting calls' first
    # ones and their cycles (no re-feed of tokens it had verified, no pass of its own for the token
    # handed to the batch)
    assert spec.refeeds == 0 and passes[0] == len(drafting) + spec.cycles, (passes, spec.as_dict())
    assert u.prefill_seconds > 0


def count_own_passes(monkeypatch) -> list[int]:
    """Counts the passes sessions run themselves (`Session.step` and `prefill`), not the batch's."""
    n = [0]
    for name in ("step", "prefill"):
        real = getattr(Session, name)

        def counted(self, *a, real=real, **kw):
            n[0] += 1
            return real(self, *a, **kw)

        monkeypatch.setattr(Session, name, counted)
    return n


def test_choices_decode_beside_the_first_which_drafts_only_alone(rt, tok) -> None:  # noqa: F811
    """`n` = 2, sampled with a seed, `speculate` 2 (the checkpoint's own drafter): the first choice,
    taken alone, hands over to the batch at its first token, so the second decodes beside it (every
    pass carries both) rather than after it; the ids are `off`'s. Fails where the first choice
    drafts to its end before the second starts."""
    w = worker(rt, tok)
    try:
        off = Request(w, tok, "long", SHORT, "off", n=2, seed=7).choices()
        r = Request(w, tok, "long", SHORT, 2, n=2, seed=7)
        got = r.choices()
    finally:
        w.close()
    assert got == off and got[0] != got[1]
    assert r.job.usage.mean_batch == 2.0 and r.job.usage.batch_passes == 2 * (SHORT - 1)


def test_a_client_gone_at_the_hand_over_leaves_the_state_off_goes_on_from(rt, tok, monkeypatch) -> None:  # noqa: F811
    """The long request drafts again past the short one; a third arrives, and the long one's client
    goes away while the token it handed to the batch waits for the pass (the newcomer's start drops
    it): the request stops, the others are served, and the state it kept after its tokens but the
    last (its session held exactly those) goes on as `off`: a prompt of those tokens reuses it and
    gets `off`'s next ids."""
    w = worker(rt, tok, states=16)
    try:
        off = Request(w, tok, "long", LONG, "off").ids()
        want_late = Request(w, tok, "late", SHORT, "off").ids()
        full = [*PROMPTS["long"], *off]
        cycle: list[int] = []

        def propose(pos: int, token: int, k: int) -> list[int]:
            cycle.append(len(long.got))
            return full[pos + 2 : pos + 2 + k]

        monkeypatch.setattr(
            rt.speculator, "drafter", lambda session: ScriptedDrafter(propose, rt.cfg.dspark.block_size)
        )
        late: list[Request] = []
        arrived = threading.Event()

        def gone(kind: str) -> None:
            if kind == "started":
                long.job.cancelled.set()

        def arrive(n: int) -> None:
            if n >= LONG // 2 and cycle and n == cycle[-1] + 2 and not late:
                late.append(Request(w, tok, "late", SHORT, "off", on_event=gone))
                arrived.set()

        short = Request(w, tok, "short", SHORT, "off")
        long = Request(w, tok, "long", LONG, 2, on_token=arrive)
        short.ids()
        end = time.monotonic() + 600
        while not (arrived.is_set() or long.done.is_set()) and time.monotonic() < end:
            time.sleep(0.01)
        assert arrived.is_set(), "the long request never drafted again once the short one had ended"
        assert late[0].ids() == want_late
        end = time.monotonic() + 60
        while w.running and time.monotonic() < end:
            time.sleep(0.01)
        got = list(long.got)
        assert not long.done.is_set() and not long.errors and w.running == 0  # stopped, not answered
        assert LONG // 2 < len(got) < LONG and got == off[: len(got)]
        again = Request(w, tok, [*PROMPTS["long"], *got], SHORT, "off")
        assert again.ids() == off[len(got) : len(got) + SHORT]
        assert again.job.usage.cached_tokens == len(PROMPTS["long"]) + len(got) - 1  # the state it kept
    finally:
        w.close()


def test_the_drafter_sees_the_batched_passes(rt, tok, monkeypatch) -> None:  # noqa: F811
    """The long request (`speculate` 2, the checkpoint's own drafter) decodes beside the short one,
    then drafts alone: its drafter observed every position the batch's passes fed (the session's
    `Observer` trace: the prompt's last segment and each batched step), so the drafting call goes
    on from it instead of starting afresh. Fails where a drafting call after a batched stretch resets
    the drafter (its window empty but for the token handed over)."""
    from dsv4stream.engine.speculate_v41 import DSparkDrafter

    seen: dict[int, list[int]] = {}  # drafter -> positions observed since it was made or reset
    resets: dict[int, int] = {}
    observe, reset = DSparkDrafter.observe, DSparkDrafter.reset

    def observed(self, taps, positions):
        seen.setdefault(id(self), []).extend(positions.tolist())
        return observe(self, taps, positions)

    def was_reset(self):
        resets[id(self)] = resets.get(id(self), 0) + 1
        seen[id(self)] = []
        return reset(self)

    monkeypatch.setattr(DSparkDrafter, "observe", observed)
    monkeypatch.setattr(DSparkDrafter, "reset", was_reset)
    w = worker(rt, tok)
    try:
        off = Request(w, tok, "long", LONG, "off").ids()
        turns0 = len(rt.engine.phases.turns)
        short = Request(w, tok, "short", SHORT, "off")  # taken first: the long one is taken beside it
        long = Request(w, tok, "long", LONG, 2)
        got = long.ids()
        short.ids()
        turns = rt.engine.phases.turns[turns0:]
    finally:
        w.close()
    assert got == off
    drafting = [t for t in turns if t.speculation is not None]
    assert len(drafting) == 1 and drafting[0].speculation.verify_passes > 0  # batched, then drafting
    # one drafter, started afresh at most where the prompt's read began (the server kept the `off`
    # request's state one token short of the prompt: its session starts there, its drafter too)
    assert len(seen) == 1 and sum(resets.values()) <= 1, resets
    (positions,) = seen.values()
    fed = len(PROMPTS["long"]) + LONG - 1  # every token but the last was fed
    assert positions == list(range(positions[0], fed)) and positions[0] <= len(PROMPTS["long"]) - 1, positions


def test_a_later_choice_drafts_once_it_is_the_last(rt, tok, monkeypatch) -> None:  # noqa: F811
    """`n` = 2, sampled with a seed, `speculate` 2, on a server with --max-batch 2 busy with a short
    request: the second choice finds no place until the short one ends, then decodes beside the
    first and outlives it; alone, it drafts (the checkpoint's own drafter), its drafter going on
    from the first's at the prompt's end. The ids are `off`'s. Fails where choices after the first
    never draft on a batching server, or start their drafter from nothing."""
    from dsv4stream.engine.speculate_v41 import DSparkDrafter

    gaps: list[tuple[int, int]] = []  # (position before, first position) where a drafter's run broke
    observe = DSparkDrafter.observe

    def observed(self, taps, positions):
        if positions[0] >= len(PROMPTS["long"]) and self.last != positions[0] - 1:
            gaps.append((self.last, int(positions[0])))
        return observe(self, taps, positions)

    monkeypatch.setattr(DSparkDrafter, "observe", observed)
    ram = StateCache(8 * planner.state_bytes_for(rt.cfg, CTX))
    w = Worker(rt, rt.cfg.vocab_size, ram, None, lambda _: None, [], tok.decode, tok.special.user, max_batch=2)
    try:
        off = Request(w, tok, "long", LONG // 2, "off", n=2, seed=11).choices()
        turns0 = len(rt.engine.phases.turns)
        short = Request(w, tok, "short", 16, "off")  # taken first: the long one's first choice beside it
        r = Request(w, tok, "long", LONG // 2, 2, n=2, seed=11)
        got = r.choices()
        short.ids()
        turns = rt.engine.phases.turns[turns0:]
    finally:
        w.close()
    assert got == off and got[0] != got[1]
    drafting = [t for t in turns if t.speculation is not None]
    assert drafting and all(t.speculation.verify_passes > 0 for t in drafting), [
        (len(t.tokens), t.speculation) for t in turns
    ]
    # past the prompt every drafter went on from the position before (the second choice's from a
    # copy of the first's at the prompt's end: it holds the prompt's taps), never from nothing
    assert not gaps, gaps


def test_tokens_carried_at_a_hand_over_ride_in_the_batchs_pass(rt, tok, monkeypatch) -> None:  # noqa: F811
    """As the first test, with a STAND-IN whose second draft is wrong every other cycle (that
    verification keeps one draft and rejects the next: the session goes back, and the tokens kept
    are carried): when the third request arrives the long one leaves drafting at such a cycle, and
    the tokens it carried go in the batch's next pass with the token it holds
    (`engine.speculate.HandOver`), not in a pass of their own. Every pass the request runs itself is
    one of its drafting calls' (their prompts, their cycles), and the ids are `off`'s. Fails where
    the hand-over feeds the carried tokens alone."""
    from dsv4stream.server import worker as worker_module

    w = worker(rt, tok)
    try:
        off = {p: Request(w, tok, p, n, "off").ids() for p, n in (("long", LONG), ("short", SHORT), ("late", SHORT))}
        full = [*PROMPTS["long"], *off["long"]]
        cycle: list[int] = []

        def propose(pos: int, token: int, k: int) -> list[int]:
            cycle.append(len(long.got))
            right = full[pos + 2 : pos + 2 + k]
            return right if len(cycle) % 2 else [right[0], *(t + 1 for t in right[1:])]

        block = rt.cfg.dspark.block_size
        monkeypatch.setattr(rt.speculator, "drafter", lambda session: ScriptedDrafter(propose, block))
        callers: list[str] = []  # who ran each pass the long request's session ran itself
        for name in ("step", "prefill"):
            real = getattr(Session, name)

            def own(self, *a, real=real, **kw):
                callers.append(sys._getframe(1).f_code.co_name)
                return real(self, *a, **kw)

            monkeypatch.setattr(Session, name, own)
        carried: list[int] = []
        hand_over = worker_module._SoloDrafts._hand_over

        def handed(self, session):
            carried.append(len(got := hand_over(self, session)))
            return got

        monkeypatch.setattr(worker_module._SoloDrafts, "_hand_over", handed)
        late: list[Request] = []

        def arrive(n: int) -> None:
            # the token after a cycle that rejected its second draft (an even cycle's first pick)
            if n >= LONG // 2 and len(cycle) % 2 == 0 and n == cycle[-1] + 2 and not late:
                late.append(Request(w, tok, "late", SHORT, "off"))

        short = Request(w, tok, "short", SHORT, "off")
        long = Request(w, tok, "long", LONG, 2, on_token=arrive)
        got = {"short": short.ids(), "long": long.ids()}
        assert late, "the long request never drafted again once the short one had ended"
        got["late"] = late[0].ids()
        spec = w.stats.speculation()
    finally:
        w.close()
    assert got == off
    assert set(callers) <= {"_pass", "_timed_prefill"}, callers
    assert spec is not None and spec.refeeds > 0 and any(carried), (carried, spec.as_dict())
