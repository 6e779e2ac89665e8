"""The running batch of the server's engine thread: each request a coroutine, one decode pass for all.

Owns: continuous batching's schedule. A request is a generator (`Worker._serve`) that runs
linearly, as a request served alone would: it reads its prompt (a prefill) and, for each token
it wants fed, yields a `Step` (its session, the token) and gets back that step's result, the
`(logits, wall seconds, seconds by phase)` that `Session.generate` takes from a batched caller,
or None when it was dropped without a pass (its client went away while it waited). `Batch.step`
runs one pass (`engine.batch.step_many`) over every request waiting for one, then resumes each
with its row; requests join (`start`) and leave (their generator returns or raises) between
passes. Nothing here picks tokens or knows of replies: each request keeps its own sampler,
stops, grammar and prefix-cache work in its coroutine, so one request's end, error or
cancellation leaves the others' rows as they were.

A new request's prefill runs inside `start`; its coroutine's prefill progress calls `step` after
each segment, so the others' decoding waits for one segment at most.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

from ..engine.batch import step_many
from ..engine.phases import StepClock
from ..engine.session import Session


@dataclass(frozen=True)
class Step:
    """A request's ask: feed `token` to `session` in the next pass."""

    session: Session
    token: int


# A request's coroutine: yields Steps, is sent each one's (logits, wall, spent) or None (dropped).
Coroutine = Generator[Step, tuple | None, None]


class Batch:
    """The requests decoding now, in the order they joined (see the module docstring).

    `serve(job)` makes a request's coroutine; `passed(jobs)` hears of each pass and whose rows it carried;
    `ended(job, error)` of each request that ended (error None: it returned)."""

    def __init__(
        self,
        serve: Callable[[object], Coroutine],
        passed: Callable[[list], None],
        ended: Callable[[object, BaseException | None], None],
        meter=None,
    ) -> None:
        self.serve = serve
        self.passed = passed
        self.ended = ended
        self.meter = meter
        self.rows: list[tuple[Coroutine, object, Step]] = []

    def start(self, job) -> None:
        """A request joins: its coroutine runs to its first step (its prefill, interleaved with
        passes of the others), or to its end."""
        gen = self.serve(job)
        self._resume(gen, job, lambda: next(gen))

    def step(self) -> None:
        """One decode pass over the requests waiting for one (none: nothing to do); a request whose
        client went away is dropped first (resumed with None, its token unfed)."""
        rows, self.rows = self.rows, []
        live = []
        for gen, job, want in rows:
            if job.cancelled.is_set():
                self._resume(gen, job, lambda g=gen: g.send(None))
            else:
                live.append((gen, job, want))
        if not live:
            return
        sessions = [want.session for _, _, want in live]
        tokens = [want.token for _, _, want in live]
        clock = StepClock(self.meter or sessions[0].engine.meter)
        try:  # (each token's reads ahead started when it was picked: `Session.generate`)
            clock.begin()
            logits = step_many(sessions, tokens)
        except Exception as e:  # noqa: BLE001  every request of the pass gets it (its sessions are torn)
            for gen, job, _ in live:
                self._resume(gen, job, lambda g=gen, err=e: g.throw(err))
            return
        wall, spent = clock.end()
        self.passed([job for _, job, _ in live])
        for b, (gen, job, _) in enumerate(live):
            self._resume(gen, job, lambda g=gen, row=logits[b]: g.send((row, wall, spent)))

    def close_all(self) -> None:
        """The server stops: every coroutine closed (its `finally` blocks run)."""
        rows, self.rows = self.rows, []
        for gen, _, _ in rows:
            gen.close()

    def _resume(self, gen: Coroutine, job, resume: Callable[[], Step]) -> None:
        try:
            want = resume()
        except StopIteration:
            self.ended(job, None)
        except Exception as e:  # noqa: BLE001  the request's own failure: reported to it alone
            self.ended(job, e)
        else:
            self.rows.append((gen, job, want))
