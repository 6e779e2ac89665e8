"""The running batch of the server's engine thread: each request a coroutine, one pass for all.

Owns: continuous batching's schedule. A request is a generator (`Worker._serve`) that runs
linearly, as a request served alone would: for each segment of its prompt it yields a `Prompt`
(its session, the segment's ids) and for each token it wants fed a `Step` (its session, the
token), and gets back that feed's result, `(logits, wall seconds, seconds by phase)` (the
logits a prompt's last segment ends with, None before; a step's row, which `Session.generate`
takes from a batched caller), or None when it was dropped without a pass (its client went away
while it waited). `Batch.step` runs one pass (`engine.batch.forward_governed`: `forward_many`,
decode passes at the thread count tuned for that many rows) over every request waiting for one:
the decode steps and the prompts' segments together, so prompts sent at once are read in the
same passes and beside the others' decoding (at most a prefill segment's tokens a pass:
`joined_passes`), then resumes each with its result; a request decoding several sequences at
once (its `n` choices) yields a list of Steps and gets a list of rows (`choices`). Requests
join (`start`) and leave (their generator returns or raises) between passes. Nothing here picks
tokens or knows of replies: each request keeps its own sampler, stops, grammar and prefix-cache
work in its coroutine, so one request's end, error or cancellation leaves the others' rows as
they were.

`choices` runs one request's choices as rows of the same passes: each choice a generator that
yields its Steps, those that run at once gathered into one list per pass, a new one started
while `room()` says the batch has a place.

`rows_that_fit` caps the batch where the experts stream: a pass of B rows touches up to B
times a token's working set of routed experts, and once that is more than the expert slots,
every pass evicts what the next one (the same requests' next tokens, which pick many of the
same experts) would have hit. Served one after another, each request keeps its hits; batched
past the slots, none does, and the batch loses to them (the demo checkpoint at 1.0 GB, 78
slots of 36 a token: 8 clients 0.84x, 2 clients 1.59x). So the batch holds as many requests as
the slots hold working sets, at least one.

A request whose prompt is read in passes of its own (images; one that drafts while alone)
prefills inside `start` or its `step`, and its prefill progress calls `step` after each segment,
so the others' decoding waits for one segment at most.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np

from ..engine.batch import Feed, forward_governed
from ..engine.session import Session
from ..errors import InternalError


@dataclass(frozen=True)
class Step:
    """A request's ask: feed `token` to `session` in the next pass."""

    session: Session
    token: int


@dataclass(frozen=True)
class Prompt:
    """A request's ask: feed `ids`, a segment of its prompt, to `session` in the next pass (beside the
    others' segments and decode steps); `last`: the prompt's last segment, whose last row's logits
    come back (else None in their place)."""

    session: Session
    ids: np.ndarray
    last: bool
    # the request's next token comes from its last row: a decode step that also feeds tokens it
    # carried (a drafting request handed to the batch after a rejected draft), counted as one
    step: bool = False


# A request's coroutine: yields a Step or a Prompt (or a list of Steps: several rows), is sent its
# (logits, wall, spent) (a list of them) or None (dropped).
Coroutine = Generator[Step | Prompt | list[Step], tuple | list | None, None]


class Batch:
    """The requests decoding now, in the order they joined (see the module docstring).

    `serve(job)` makes a request's coroutine; `passed(jobs)` hears of each pass and whose rows it
    carried (a job once per row);
    `ended(job, error)` of each request that ended (error None: it returned)."""

    def __init__(
        self,
        serve: Callable[[object], Coroutine],
        passed: Callable[[list], None],
        ended: Callable[[object, BaseException | None], None],
    ) -> None:
        self.serve = serve
        self.passed = passed
        self.ended = ended
        self.rows: list[tuple[Coroutine, object, Step | list[Step]]] = []

    def start(self, job) -> None:
        """A request joins: its coroutine runs to its first step (its prefill, interleaved with
        passes of the others), or to its end."""
        gen = self.serve(job)
        self._resume(gen, job, lambda: next(gen))

    def step(self) -> None:
        """One pass over the requests waiting for one (none: nothing to do): every decode step and
        every prompt segment asked for; a request whose client went away is dropped first
        (resumed with None, its tokens unfed). A request that asked for several rows (a list of
        Steps: its `n` choices) gets their results as a list. The pass holds at most a prefill
        segment's tokens (`joined_passes`: the plan's activations): segments beyond go in more
        passes, one after another, before anyone is resumed."""
        rows, self.rows = self.rows, []
        live = []
        for gen, job, want in rows:
            if job.cancelled.is_set():
                self._resume(gen, job, lambda g=gen: g.send(None))
            else:
                live.append((gen, job, want))
        if not live:
            return
        asks = [want if isinstance(want, list) else [want] for _, _, want in live]
        feeds, owner, steps = [], [], []
        for r, ask in enumerate(asks):
            for a in ask:
                prompt = isinstance(a, Prompt)
                ids = a.ids if prompt else np.asarray([a.token], dtype=np.int64)
                feeds.append(Feed(a.session, ids, ("last" if a.last else "none") if prompt else "all"))
                owner.append(r)
                steps.append(not prompt or a.step)
        got: list[tuple | None] = [None] * len(feeds)
        failed: dict[int, Exception] = {}
        for group in joined_passes(feeds):
            try:  # (each token's reads ahead started when it was picked: `Session.generate`)
                logits, wall, spent = forward_governed([feeds[j] for j in group])  # threads tuned per rows
            except Exception as e:  # noqa: BLE001  every request of the pass gets it (its sessions are torn)
                failed.update((owner[j], e) for j in group)
                continue
            decoding = [live[owner[j]][1] for j in group if steps[j]]
            if decoding:
                self.passed(decoding)
            for j, out in zip(group, logits, strict=True):
                got[j] = (out[0] if feeds[j].logits == "all" else out, wall, spent)
        j = 0
        for r, ((gen, job, want), ask) in enumerate(zip(live, asks, strict=True)):
            mine, j = got[j : j + len(ask)], j + len(ask)
            if r in failed:
                self._resume(gen, job, lambda g=gen, err=failed[r]: g.throw(err))
                continue
            fed = mine if isinstance(want, list) else mine[0]
            self._resume(gen, job, lambda g=gen, f=fed: g.send(f))

    def close_all(self) -> None:
        """The server stops: every coroutine closed (its `finally` blocks run)."""
        rows, self.rows = self.rows, []
        for gen, _, _ in rows:
            gen.close()

    def _resume(self, gen: Coroutine, job, resume: Callable[[], Step | list[Step]]) -> None:
        try:
            want = resume()
        except StopIteration:
            self.ended(job, None)
        except Exception as e:  # noqa: BLE001  the request's own failure: reported to it alone
            self.ended(job, e)
        else:
            self.rows.append((gen, job, want))


def joined_passes(feeds: list[Feed]) -> list[list[int]]:
    """The feeds of one `Batch.step` in passes (indices): the decode steps together in the first,
    the prompts' segments beside them while the pass holds at most a prefill segment's tokens
    (the sessions' `segment`, the plan's: the activations it budgets), the rest in as few passes
    more, in order. A segment never waits: each step reads one segment of every prompt."""
    cap = max((f.session.segment for f in feeds if f.logits != "all"), default=0)
    groups: list[list[int]] = [[j for j, f in enumerate(feeds) if f.logits == "all"]]
    total = len(groups[0])
    for j, f in enumerate(feeds):
        if f.logits == "all":
            continue
        if groups[-1] and total + f.ids.size > cap:
            groups.append([])
            total = 0
        groups[-1].append(j)
        total += f.ids.size
    return [g for g in groups if g]


def rows_that_fit(plan, most: int) -> int:
    """The most rows (at most `most`, at least 1) whose pass's routed experts, a working set
    each, fit in the expert slots left beside the pass's activations (`Plan.prefill_slots`);
    `most` where every expert fits anyway (nothing streams)."""
    n = plan.needs
    if plan.expert_slots >= n.total_experts or not n.working_set:
        return most
    rows = 1
    while rows < most and (rows + 1) * n.working_set <= plan.prefill_slots(rows + 1):
        rows += 1
    return rows


def choices(
    first: Generator, more: list[Callable[[bool], Generator]], room: Callable[[], bool], ready: Callable[[], bool]
) -> Generator[list[Step], list | None, list]:
    """Run `first` and the choices `more` makes (in order) as rows of the same passes: yields each
    pass's Steps as one list, is sent their rows (a list) or None (dropped: every choice gets
    None); returns each choice's return value, `first`'s first. A choice of `more` starts once
    `ready()` (the first has what the others start from) and while `room()` (a place in the
    batch, taken: the choice is made with True), or when no other choice runs (made with False). Choices that feed their tokens themselves (a server
    with --max-batch 1) run to their end when started: one after another, as before. On an
    error, the choices still running are closed."""
    gens: list[Generator] = [first]
    wants: dict[int, Step] = {}
    results: dict[int, object] = {}

    def advance(i: int, send) -> None:
        try:
            wants[i] = send()
        except StopIteration as e:
            results[i] = e.value

    try:
        advance(0, lambda: next(first))
        while True:
            while len(gens) - 1 < len(more) and (not wants or ready()):
                if not ready():
                    raise InternalError("a choice was to start before the first had reached its prompt's end")
                claimed = room()
                if wants and not claimed:
                    break
                g = more[len(gens) - 1](claimed)
                gens.append(g)
                advance(len(gens) - 1, lambda g=g: next(g))
            if not wants:
                return [results[i] for i in range(len(gens))]
            order = sorted(wants)
            fed = yield [wants.pop(i) for i in order]
            for k, i in enumerate(order):
                advance(i, lambda g=gens[i], f=None if fed is None else fed[k]: g.send(f))
    finally:
        for g in gens:
            g.close()
