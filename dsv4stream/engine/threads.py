"""The kernel thread count of decode steps, chosen by timing them (`ThreadGovernor`).

A decode step runs ~60 parallel regions of a few hundred microseconds each. When another
program keeps one of the cores busy, every region waits for its descheduled worker: on 2 AMD
EPYC cores with a busy co-tenant a step measured 393 ms at 2 threads against 118 ms at 1 (and
70 against 112 quiet). No static count is right for both, so the governor times the steps'
compute (wall time less the waits on reads, which threads do not change) at the count in use,
now and then tries another count for a few steps, and keeps whichever was faster. The kernels'
results do not depend on the thread count, so neither do the ids.

Owns the choice only: the caller (`Session.generate`; a batched pass, `engine.batch.step_governed`)
applies it with `kernels.set_threads` and reports each step's time. Not used when the user fixes
`--threads`. A batched pass of B sequences takes longer than one of a single sequence, and B changes
as requests join and leave, so passes of B > 1 rows are timed by a governor of their own per B
(`for_rows`): a count is only ever compared with another on passes of the same size.
"""

from __future__ import annotations

import statistics
from collections import deque

RECENT = 4  # steps per count whose median is its current figure
PROBE_STEPS = 3  # steps a tried count runs (the median drops a first step's thread start-up)
FIRST_PROBE = 4  # steps at the most threads before the first try: a busy core is found early
PERIOD = 32  # steps between tries of a count, doubled after each loss up to MAX_PERIOD
# Quiet on 2 cores a losing try of 1 thread costs 3 x 42 ms per 256 steps of 70 ms (0.7 %); with
# a busy core a try of 2 threads 3 x 275 ms per 256 of 118 ms (2.7 %), and the run is back at 2
# threads within 256 steps of the other program's end (its end does not slow anything down).
MAX_PERIOD = 256
MARGIN = 0.9  # a tried count takes over when its steps took at most this share of the current's
SLOWER = 1.5  # the current count's steps this much slower than its best: the load changed, try the others now


def candidates(most: int) -> tuple[int, ...]:
    """The counts worth trying below `most` usable threads: one core lost to a co-tenant, half
    of them, one."""
    return tuple(sorted({most, max(1, most - 1), max(1, most // 2), 1}, reverse=True))


class ThreadGovernor:
    """Which thread count the next decode step runs at (`next_threads`), from the compute
    seconds of the steps so far (`record`)."""

    def __init__(self, most: int) -> None:
        self.most = max(1, most)
        self.counts = candidates(self.most)
        self.current = self.most
        self.recent: dict[int, deque[float]] = {c: deque(maxlen=RECENT) for c in self.counts}
        self.period = {c: PERIOD for c in self.counts}
        self.due = {c: FIRST_PROBE + i for i, c in enumerate(self.counts)}  # step of each count's next try
        self.steps = {c: 0 for c in self.counts}  # decode steps run at each count
        self.switches = 0
        self._best: float | None = None  # the current count's fastest recent median
        self._step = 0
        self._probe: int | None = None
        self._probe_left = 0
        self._probe_times: list[float] = []
        self._by_rows: dict[int, ThreadGovernor] = {}  # batched passes, per rows carried

    def for_rows(self, rows: int) -> ThreadGovernor:
        """The governor of decode passes that carry `rows` sequences: this one for a single
        sequence, else one per batch size, made on first use."""
        if rows <= 1:
            return self
        if rows not in self._by_rows:
            self._by_rows[rows] = ThreadGovernor(self.most)
        return self._by_rows[rows]

    def next_threads(self) -> int:
        """The count for the step about to run."""
        if self._probe is None and len(self.counts) > 1:
            due = [c for c in self.counts if c != self.current and self.due[c] <= self._step]
            if due and self.recent[self.current]:
                self._probe, self._probe_left, self._probe_times = min(due, key=self.due.get), PROBE_STEPS, []
        return self._probe if self._probe is not None else self.current

    def record(self, threads: int, seconds: float) -> None:
        """A step ran at `threads` and its compute took `seconds`."""
        self._step += 1
        self.steps[threads] = self.steps.get(threads, 0) + 1
        if threads != self._probe:
            if threads in self.recent:
                self.recent[threads].append(seconds)
            if threads == self.current and len(self.recent[threads]) == RECENT:
                self._watch(statistics.median(self.recent[threads]))
            return
        self._probe_times.append(seconds)
        self._probe_left -= 1
        if self._probe_left:
            return
        tried, self._probe = threads, None
        mine = statistics.median(self._probe_times)
        theirs = statistics.median(self.recent[self.current])
        self.recent[tried].clear()
        self.recent[tried].extend(self._probe_times)
        if mine <= MARGIN * theirs:
            old, self.current = self.current, tried
            self.switches += 1
            self.period[old] = PERIOD  # the load may change back: try the old count soon
            self.due[old] = self._step + PERIOD
            self.period[tried] = PERIOD
            self._best = None
        else:
            self.period[tried] = min(MAX_PERIOD, 2 * self.period[tried])
            self.due[tried] = self._step + self.period[tried]

    def _watch(self, now: float) -> None:
        """A try of every other count is due at once when the current count slows down: a
        busy core found after a long quiet stretch would otherwise wait for MAX_PERIOD steps."""
        if self._best is None or now < self._best:
            self._best = now
        elif now > SLOWER * self._best:
            self._best = now  # once per slowdown
            for c in self.counts:
                if c != self.current:
                    self.period[c] = PERIOD
                    self.due[c] = min(self.due[c], self._step)

    def summary(self) -> dict[str, int]:
        """Decode steps (batched passes among them) per thread count, keys as text (JSON's):
        {"2": 118, "1": 6}."""
        steps = dict(self.steps)
        for g in self._by_rows.values():
            for c, n in g.steps.items():
                steps[c] = steps.get(c, 0) + n
        return {str(c): n for c, n in sorted(steps.items(), reverse=True) if n}
