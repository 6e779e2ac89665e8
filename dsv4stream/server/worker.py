"""The one thread that owns the engine: requests queue up and are served one at a time.

Owns: the job queue, finding the longest kept state a prompt extends (RAM, then disk),
restoring it into a fresh session, `Runtime.generate` over the new tokens only, feeding
each token to the job's `ReplyStream`, stopping at the next token (or prefill chunk) once
the client has gone, keeping states after the request, and the figures of each request.
Handlers never touch the runtime; they get events through the job's `emit`.

States kept per request, each one a segment boundary of the prefill (`boundaries`, so that
taking them changes no logits beyond what any segmentation does): one token short of the
prompt (a regenerate, or the next turn of a thinking chat, whose `<think>` became
`</think>`, reuses all but that token), at the start of the prompt's last user turn (an
edited last message reuses the conversation before it), at the prompt's end, and after the
reply. Before the lookup, a reply the client sends back as text is given back the ids the
server sampled for it (`StateCache.splice`): re-tokenising a reply's text need not give the
same ids, and then the state after the reply would never match.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..engine.state import SessionState
from ..errors import Dsv4Error, InternalError
from ..run.runtime import Runtime
from ..text.sampler import SamplingParams, make_pick
from .cache import DiskCache, StateCache
from .reply import ReplyStream
from .stats import LiveStats

Log = Callable[[str], None]


class Cancelled(Exception):
    """The client went away."""


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queued_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    cache_source: str = ""  # "ram", "disk" or ""

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    params: SamplingParams
    reply: ReplyStream
    emit: Callable[
        [str, object], None
    ]  # ("progress", (done, total)) / ("delta", Delta) / ("done", Outcome) / ("error", e)
    cancelled: threading.Event = field(default_factory=threading.Event)
    usage: Usage = field(default_factory=Usage)
    submitted: float = field(default_factory=time.perf_counter)
    counted: bool = False  # its figures went to the live stats


class Worker:
    def __init__(
        self,
        rt: Runtime,
        n_ids: int,
        ram: StateCache,
        disk: DiskCache | None,
        log: Log,
        banned: list[int] | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
        turn_id: int | None = None,
    ) -> None:
        self.rt = rt
        self.decode = decode  # the tokenizer's decode, for splicing sampled ids back (None: no splice)
        self.turn_id = turn_id  # the id that opens a user turn (<｜User｜>): a state is kept before the last one
        self.banned = banned or []  # special ids never sampled, as in `dsv4 run` (text.sampler.banned_ids)
        self.stats = LiveStats(rt)
        self.n_ids = n_ids  # ids the tokenizer can print: the sampler's range
        self.ram = ram
        self.disk = disk
        self.log = log
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.busy = False
        self.served = 0
        self._thread = threading.Thread(target=self._loop, name="dsv4-engine", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Requests submitted and not answered yet (waiting, or being generated)."""
        return self.jobs.qsize() + (1 if self.busy else 0)

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def close(self) -> None:
        self.jobs.put(None)
        self._thread.join(timeout=5)

    # ---- the engine thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.busy = True
            try:
                if job.cancelled.is_set():
                    continue
                job.usage.queued_seconds = time.perf_counter() - job.submitted
                try:
                    self._run(job)
                finally:
                    self._count(job)
            except Cancelled:
                u = job.usage
                self.log(f"dsv4: request stopped, the client went away: {u.completion_tokens} tokens generated")
            except Dsv4Error as e:
                job.emit("error", e)
            except Exception as e:  # noqa: BLE001  a programming error: traceback to the log, a 500 to the client
                self.log(traceback.format_exc().rstrip())
                job.emit("error", e)
            finally:
                self.busy = False
                self.served += 1

    def _count(self, job: Job) -> None:
        if not job.counted:
            job.counted = True
            self.stats.end(job.usage)

    def _lookup(self, ids: list[int]) -> tuple[int, SessionState | None, str]:
        hit = self.ram.lookup(ids)
        got, state, source = (hit[0], hit[1], "ram") if hit else (0, None, "")
        if self.disk is not None:
            far = self.disk.lookup(ids, shorter_than=got)
            if far is not None:
                got, state, source = far[0], far[1], "disk"
                self.ram.put(ids[:got], state)
        return got, state, source

    def _keep(self, kept: list[tuple[list[int], SessionState]]) -> None:
        for ids, state in kept:
            self.ram.put(ids, state)
            if self.disk is not None:
                self.disk.put(ids, state)

    def keep_points(self, ids: Sequence[int], cached: int) -> list[int]:
        """Positions past `cached` where the prefill keeps a state: the last user turn's start and
        one token short of the prompt."""
        points = {len(ids) - 1}
        if self.turn_id is not None:
            last = max((i for i in range(cached + 1, len(ids)) if ids[i] == self.turn_id), default=None)
            if last is not None:
                points.add(last)
        return sorted(p for p in points if cached < p < len(ids))

    def _run(self, job: Job) -> None:
        rt, u = self.rt, job.usage
        ids = self.ram.splice(job.ids, self.decode) if self.decode is not None else job.ids
        cached, state, u.cache_source = self._lookup(ids)
        self.stats.begin(len(ids), cached)
        session = rt.session(on_route=self.stats.on_route)  # the plan's prefill segment
        if state is not None:
            session.restore(state)
        new = ids[cached:]
        keep_at = self.keep_points(ids, cached)
        kept: list[tuple[list[int], SessionState]] = []

        def progress(done: int, total: int) -> None:
            if job.cancelled.is_set():
                raise Cancelled
            if cached + done in keep_at:
                kept.append((ids[: cached + done], session.snapshot()))
            self.stats.prefilled(cached + done, len(ids))
            job.emit("progress", (cached + done, len(ids)))

        pick = make_pick(job.params, self.n_ids, np.random.default_rng(job.params.seed), self.banned)
        eos = job.reply.eos
        got: list[int] = []
        t0 = time.perf_counter()
        t_first = t0

        def layer_done(step) -> None:
            if job.cancelled.is_set():  # a client gone mid-prefill: stop within one layer
                raise Cancelled

        boundaries = [p - cached for p in keep_at]
        steps = rt.generate(
            session, new, job.max_tokens, pick, (eos,), progress=progress, on_layer=layer_done, boundaries=boundaries
        )
        for tok in steps:
            if not got:
                t_first = time.perf_counter()
                kept.append((list(ids), session.snapshot()))
            self.stats.token(first=not got)
            got.append(tok)
            delta = job.reply.push(tok)
            if delta:
                job.emit("delta", delta)
            if job.reply.stopped or job.cancelled.is_set():
                break
        t_end = time.perf_counter()
        u.prompt_tokens, u.cached_tokens, u.completion_tokens = len(ids), cached, len(got)
        u.prefill_seconds, u.decode_seconds = t_first - t0, t_end - t_first
        # the last token yielded was never fed: the session has read ids + got[:-1]
        if session.pos != len(ids) + len(got) - 1:
            raise InternalError(f"session at {session.pos} after {len(ids)} prompt + {len(got)} generated tokens")
        if len(got) > 1:
            kept.append((ids + got[:-1], session.snapshot()))
        if got:
            self.ram.remember(ids + got)
        if job.cancelled.is_set():
            self._keep(kept)
            raise Cancelled
        reason = "stop" if got and got[-1] == eos else "length"
        last, outcome = job.reply.finish(reason)
        if last:
            job.emit("delta", last)
        # counted and out of the queue before "done": a client that asks /v1/stats next sees it
        self._count(job)
        self.busy = False  # answered, though the kept states are still to be written
        job.emit("done", outcome)
        self._keep(kept)  # after "done": the client does not wait for the disk
