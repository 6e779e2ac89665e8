"""The one thread that owns the engine: requests queue up and are decoded together, up to --max-batch.

Owns: the job queue, finding the longest kept state a prompt extends (RAM, then disk),
restoring it into a fresh session, `Runtime.generate` over the new tokens only, feeding
each token to the job's `ReplyStream`, stopping at the next token (or prefill chunk) once
the client has gone, keeping states after the request, and the figures of each request.
Handlers never touch the runtime; they get events through the job's `emit`.

Continuous batching (`batching.Batch`): each request runs as a coroutine (`_serve`), written as
one request served alone would be, that yields each token it wants fed and gets back its row of
one decode pass shared by every running request (`engine.batch.step_many`: the same logits as
its own step, bit for bit). Requests join between passes while fewer than `max_batch` run (the
rest wait in the queue; where the experts stream, `--max-batch` is lowered to the requests whose
experts the slots hold: `batching.rows_that_fit`); a new request's prompt is read in the batch's
passes, segment by segment beside the others' segments and decode steps (`_read_prompt`; an idle
server waits `GATHER` for requests sent together), so prompts sent at once are read together; a
request leaves when it ends, fails or its client goes, and the others' rows are untouched. Each
keeps its own picker (sampling, seed, logit bias, grammar, logprobs), stops and kept states.
A request that may draft (`--speculate`) drafts while it is alone in flight and steps in the
batch's plain passes while others are, handed over between two tokens each way (`_SoloDrafts`);
its drafter sees the batched passes too (`engine.speculate.Observer`), so it drafts again with
its window full.

States kept per request, each one a segment boundary of the prefill (`boundaries`, so that
taking them changes no logits beyond what any segmentation does): one token short of the
prompt (a regenerate, or the next turn of a thinking chat, whose `<think>` became
`</think>`, reuses all but that token), at the start of the prompt's last user turn (an
edited last message reuses the conversation before it), at the prompt's end, and after the
reply. Before the lookup, a reply the client sends back as text is given back the ids the
server sampled for it (`StateCache.splice`): re-tokenising a reply's text need not give the
same ids, and then the state after the reply would never match.

`n` > 1 choices share the prompt: the first choice runs as a single one would; once it has its
first token, each other choice restores the state the first kept at the prompt's end and starts
from the prompt's own logits (kept by the first choice's picker), so the prompt is read once.
The choices decode together, as rows of the same passes (`batching.choices`), each in a place
of the batch (`_claim`: a request's extra choices count against --max-batch; one that finds
none waits for a choice of its request to end); with --max-batch 1 they run one after another.
Every choice goes through `Runtime.generate` (its steps in the run's figures) with its own
picker and seed stream, so its ids are those it gets alone; its sampled ids are remembered for
the splice.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..engine.phases import Turn
from ..engine.session import segment_cuts
from ..engine.spec_draws import PositionUniforms
from ..engine.speculate import HandOver, Observer
from ..engine.state import SessionState
from ..errors import Dsv4Error, InternalError
from ..run.runtime import Runtime
from ..text.sampler import SamplingParams
from .batching import Batch, Coroutine, Prompt, Step, choices, rows_that_fit
from .cache import DiskCache, StateCache
from .decoding import Controls, Picker
from .grammar import Grammars
from .images import PromptImages
from .reply import Outcome, ReplyStream
from .stats import LiveStats, RequestStats

Log = Callable[[str], None]


# seconds a batching server that was idle waits, after a request, for others sent at the same time
# (parsed and queued one after another by the server's handlers: a few ms apart)
GATHER = 0.02

# token boundaries in a row a batching server's request must find itself alone at (no other in
# flight or waiting) before it drafts again (`_SoloDrafts`): requests that come and go a few
# tokens apart (a client's burst, an agent's next call) leave it batched, rather than restarting
# its drafter for each gap; at most this many tokens go undrafted after an overlap
SETTLE = 4


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
    batch_passes: int = 0  # decode passes that carried its tokens
    batch_rows: int = 0  # requests those passes carried, summed (with batch_passes: its mean batch)

    @property
    def mean_batch(self) -> float:
        return self.batch_rows / self.batch_passes if self.batch_passes else 0.0

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    params: SamplingParams
    reply: ReplyStream
    # ("progress", (done, total)) / ("delta", Delta) / ("done", Outcome) / ("error", e), and for the
    # chat page: ("queued", requests ahead) / ("sample", per segment or token) / ("summary", at the end)
    emit: Callable[[str, object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    usage: Usage = field(default_factory=Usage)
    submitted: float = field(default_factory=time.perf_counter)
    counted: bool = False  # its figures went to the live stats
    controls: Controls = field(default_factory=Controls)
    more_replies: list[ReplyStream] = field(default_factory=list)  # choices 1.. when n > 1
    grammars: Grammars | None = None  # with controls.grammar
    thinking: bool = False  # the reply opens with reasoning (the grammar starts after it)
    pickers: list[Picker] = field(default_factory=list)  # one per choice, once it has started
    logprobs: dict[int, list] = field(default_factory=dict)  # per choice: the answer's tokens' entries
    lp_unsent: dict[int, list] = field(default_factory=dict)  # per choice: entries not yet in a delta
    images: PromptImages | None = None  # V4.1: the prompt's images; `ids` hold their spans keyed by image
    live: RequestStats | None = None  # its live figures while it runs
    speculate: str | int | None = None  # the request's speculative decoding (None: the server's --speculate)
    decoding: int = 0  # its choices decoding or still to start (`_serve`: one drafts only when it is the last)
    # the first choice's drafter at the prompt's end (`n` > 1): each later choice's starts from a copy
    drafter_at_prompt_end: object | None = None

    @property
    def replies(self) -> list[ReplyStream]:
        return [self.reply, *self.more_replies]


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
        max_batch: int = 1,
    ) -> None:
        if max_batch < 1:
            raise InternalError(f"max_batch {max_batch}: at least 1")
        self.rt = rt
        self.decode = decode  # the tokenizer's decode, for splicing sampled ids back (None: no splice)
        self.turn_id = turn_id  # the id that opens a user turn (<｜User｜>): a state is kept before the last one
        self.banned = banned or []  # special ids never sampled, as in `dsv4 run` (text.sampler.banned_ids)
        self.stats = LiveStats(rt)
        self.n_ids = n_ids  # ids the tokenizer can print: the sampler's range
        self.ram = ram
        self.disk = disk
        self.log = log
        self.asked_batch = max_batch  # --max-batch: above 1, the server was planned without a drafter
        self.max_batch = rows_that_fit(rt.plan, max_batch)  # requests decoded together at most
        if self.max_batch < max_batch:
            p = rt.plan
            log(
                f"dsv4: decoding at most {self.max_batch} request(s) together, not {max_batch}: the experts stream,"
                f" and a pass of more would not hold its experts ({p.needs.working_set} a request) in the"
                f" {p.expert_slots} expert slots, so every pass would evict what the next one hits;"
                " the others wait in the queue (a larger --budget holds more)"
            )
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.batch = Batch(self._serve, self._passed, self._ended)
        self._live: set[int] = set()  # id() of the jobs running (taken, not answered yet)
        self._extra = 0  # places taken by requests' extra choices decoding beside their first (`_claim`)
        self.served = 0
        self.recent_seconds: deque[float] = deque(maxlen=8)  # wall time of the last requests, for Retry-After
        self._thread = threading.Thread(target=self._loop, name="dsv4-engine", daemon=True)
        self._thread.start()

    @property
    def batched(self) -> bool:
        """Whether requests are decoded together (`--max-batch` above 1, asked: a streaming cap of 1
        stays batched). A drafting request (`--speculate`) verifies several tokens in a pass of its
        own, which a pass shared with other requests cannot carry: a batching server drafts only
        while one request is in flight (`_SoloDrafts`), a server with --max-batch 1 always."""
        return self.asked_batch > 1

    def _may_draft(self, job: Job) -> bool:
        """Whether the request's choices hand over between drafting and the batch (`_SoloDrafts`): a
        batching server's request whose `speculate` is not off (with --max-batch 1 every request
        drafts on its own)."""
        return self.batched and self.rt.speculator.resolve(job.speculate) != "off"

    def _alone(self) -> bool:
        """One request in flight (the caller's), no other choice of it decoding beside it (`n` > 1),
        and none waiting."""
        return self.places == 1 and not self.jobs.qsize()

    def _next(self, steps, session, tok: int):
        """The token after `tok` from `steps` (None: none, or dropped without a pass): batched,
        `tok` is fed in the next pass with the others' (a `Step` yielded to the `Batch`); alone, the
        generator feeds it itself (and may draft). A batching server's request that may draft
        (`_SoloDrafts`) is handed over at this boundary: from drafting to the batch's plain passes
        once another request is in flight or waiting (or a choice of its own is to decode beside
        it), and back once it has been alone `SETTLE` boundaries in a row."""
        if not self.batched:
            return next(steps, None)
        if isinstance(steps, _SoloDrafts):
            # no other request in flight or waiting, no other choice of its own decoding or to start
            # (a choice after the first may hold a place of its own: `_claim`)
            alone = len(self._live) == 1 and not self.jobs.qsize() and steps.single()
            if steps.drafting:
                if alone or steps.verified_ahead(session):  # the next token is already verified and fed: free
                    return next(steps, None)
                return (yield from steps.to_batched(tok, session))
            if steps.settled(alone):
                return steps.to_drafting(tok, session)
        fed = yield Step(session, tok)
        return None if fed is None else steps.send(fed)

    @property
    def busy(self) -> bool:
        return bool(self._live)

    @property
    def queued(self) -> int:
        """Requests submitted and not answered yet (waiting, or being generated)."""
        return self.jobs.qsize() + self.running

    @property
    def waiting(self) -> int:
        """Requests in the queue, behind the batch."""
        return self.jobs.qsize()

    @property
    def running(self) -> int:
        """Requests being generated (at most `max_batch`)."""
        return len(self._live)

    @property
    def ahead(self) -> int:
        """Requests a new one would wait behind: the queue, and one more while the batch is full
        (with --max-batch 1: every request not answered yet)."""
        return self.jobs.qsize() + (1 if self.running >= self.max_batch else 0)

    def retry_after(self) -> int:
        """Seconds until the queue has likely moved by one place: the mean time of the
        recent requests times the requests ahead (at least 1), over the batch's places."""
        recent = self.recent_seconds or [1.0]
        return max(1, round(sum(recent) / len(recent) * max(self.ahead, 1) / self.max_batch))

    def submit(self, job: Job) -> None:
        ahead = self.ahead  # shown to the user; the next take corrects it
        self.jobs.put(job)
        if ahead:
            job.emit("queued", ahead)

    def _tell_positions(self) -> None:
        """A job was taken: each one still waiting moves up."""
        with self.jobs.mutex:
            waiting = [j for j in self.jobs.queue if j is not None]
        for i, j in enumerate(waiting):
            j.emit("queued", i + 1)

    def close(self) -> None:
        self.jobs.put(None)
        self._thread.join(timeout=5)

    # ---- the engine thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        """Take requests while the batch has room (waiting for one only when nothing runs), then
        run one pass of the batch (its prompts' next segments and its decode steps). A request
        taken while nothing ran waits `GATHER` seconds for others sent with it (each one arriving
        waits as long again, up to --max-batch), so that prompts sent together are read together;
        while requests run, a new one joins at the next pass without waiting."""
        while True:
            gathering = False
            while self.places < self.max_batch:
                try:
                    if gathering:
                        job = self.jobs.get(timeout=GATHER)
                    else:
                        gathering = self.batched and not self.batch.rows
                        job = self.jobs.get(block=not self.batch.rows)
                except queue.Empty:
                    break
                if job is None:
                    self.batch.close_all()
                    return
                self._tell_positions()
                if job.cancelled.is_set():
                    self.served += 1
                    continue
                job.emit("queued", 0)
                job.usage.queued_seconds = time.perf_counter() - job.submitted
                self._live.add(id(job))
                self.batch.start(job)
            self.batch.step()

    def _passed(self, jobs: list[Job]) -> None:
        """A decode pass carried these jobs' tokens: the live stats, each one's share of the batch."""
        self.stats.passed(len(jobs))
        for job in jobs:
            job.usage.batch_passes += 1
            job.usage.batch_rows += len(jobs)

    def _ended(self, job: Job, error: BaseException | None) -> None:
        """A request's coroutine ended (answered, stopped or failed): report and count it."""
        if isinstance(error, Cancelled):
            u = job.usage
            self.log(f"dsv4: request stopped, the client went away: {u.completion_tokens} tokens generated")
        elif isinstance(error, Dsv4Error):
            job.emit("error", error)
        elif error is not None:  # a programming error: traceback to the log, a 500 to the client
            self.log("".join(traceback.format_exception(error)).rstrip())
            job.emit("error", error)
        self._count(job)
        self.recent_seconds.append(job.usage.seconds)
        self._live.discard(id(job))
        self.served += 1

    def _count(self, job: Job) -> dict | None:
        """The job's figures to the live stats, once; returns its summary the first time."""
        if job.counted:
            return None
        job.counted = True
        return self.stats.end(job.usage, job.live) if job.live is not None else None

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

    def _serve(self, job: Job) -> Coroutine:
        """One request, as the batch runs it (`batching.Batch`): its prefill here, after each
        segment of which the others get a decode pass; then each token it wants fed is yielded
        as a `Step`, and the pass's row comes back (None: dropped, its client gone)."""
        rt, u = self.rt, job.usage
        ids = self.ram.splice(job.ids, self.decode) if self.decode is not None else job.ids
        cached, state, u.cache_source = self._lookup(ids)
        images = job.images
        if images is not None and cached < images.end(ids):  # images go in a first prefill only (the reference's rule)
            cached, state, u.cache_source = 0, None, ""
        u.prompt_tokens, u.cached_tokens = len(ids), cached
        job.emit("started", (cached, len(ids)))
        job.live = live = self.stats.begin(len(ids), cached)
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
            job.emit("sample", self.stats.prefilled(live, cached + done, len(ids)))
            job.emit("progress", (cached + done, len(ids)))
            if cached + done < len(ids) and not together:
                self.batch.step()  # the others' next tokens between two segments of this prompt

        pick = self._picker(job, 0)
        got: list[int] = []

        def layer_done(step) -> None:
            if job.cancelled.is_set():  # a client gone mid-prefill: stop within one layer
                raise Cancelled

        boundaries = [p - cached for p in keep_at]
        # a client gone while its image is in the tower stops it between two blocks
        spans = images.spans(rt.engine, ids, layer_done) if images is not None and cached == 0 else None
        fed = images.real(new) if images is not None else new
        # a batching server's request drafts while no other is in flight (`_SoloDrafts`): from the
        # start if it is taken alone, else from when it is left alone
        may_draft = self._may_draft(job)
        solo = may_draft and self._alone()
        # batched, the drafter still sees each pass (its window full when the request drafts again)
        observer = Observer(session, rt.speculator.drafter(session)) if may_draft else None
        if may_draft and not solo:
            session.trace = observer
        # batched, the prompt's segments go in the batch's passes, beside the others' segments and
        # decode steps (`_read_prompt`); a prompt with images is read in passes of its own
        together = self.batched and not solo and images is None and len(fed) > 0
        if together:
            t_read = time.perf_counter()
            last = yield from self._read_prompt(session, fed, boundaries, progress)
            steps = rt.generate(
                session, fed, job.max_tokens, pick, (job.reply.eos,), logits=last, batched=True,
                speculate=job.speculate, uniforms=pick.rng, prompt_read=t_read,
            )  # fmt: skip
        else:
            steps = rt.generate(
                session, fed, job.max_tokens, pick, (job.reply.eos,), progress=progress, on_layer=layer_done,
                boundaries=boundaries, spans=spans, batched=self.batched and not solo, speculate=job.speculate,
                uniforms=pick.rng,
            )  # fmt: skip
        if may_draft:
            steps = self._solo_drafts(job, session, steps, solo, len(ids), pick, job.reply.eos, observer)
        t_first: list[float] = []  # when the first token was picked: the decode's start
        at_prompt_end: list[SessionState] = []

        def first_token() -> None:
            t_first.append(time.perf_counter())
            at_prompt_end.append(session.snapshot())
            kept.append((list(ids), at_prompt_end[0]))
            if may_draft and len(job.replies) > 1:  # (a stand-in drafter may not copy)
                copy = getattr(rt.speculator.drafter(session), "copy", None)
                job.drafter_at_prompt_end = copy() if copy is not None else None

        job.decoding = len(job.replies)
        first = self._first_choice(job, steps, session, ids, got, kept, first_token)
        more = [
            lambda claimed, i=i: self._more(job, i, ids, at_prompt_end[0], pick.first_logits, turns, claimed)
            for i in range(1, len(job.replies))
        ]
        turns = [session.turn]
        # the choices decode together, in the batch's places (one after another with --max-batch 1)
        outcomes = yield from choices(first, more, self._claim, lambda: bool(at_prompt_end))
        u.prompt_tokens, u.cached_tokens = len(ids), cached
        turns[0] = session.turn
        # a request handed over between drafting and batched passes: its first call's record holds the prompt's time
        first_turn = steps.turns[0] if isinstance(steps, _SoloDrafts) and steps.turns else turns[0]
        u.prefill_seconds = first_turn.first_token_seconds or 0.0
        u.decode_seconds = time.perf_counter() - t_first[0] if t_first else 0.0
        # counted and out of the running set before "done": a client that asks /v1/stats next sees it
        summary = self._count(job)
        if summary is not None:
            job.emit("summary", summary)
        self._live.discard(id(job))  # answered, though the kept states are still to be written
        job.emit("done", outcomes)
        self._keep(kept)  # after "done": the client does not wait for the disk

    def _read_prompt(
        self, session, ids: Sequence[int], boundaries: Sequence[int], progress: Callable[[int, int], None]
    ) -> Generator[Prompt, tuple | None, np.ndarray]:
        """The prompt `ids` fed to `session` in the segments its own prefill would cut (`segment_cuts`:
        the plan's segment and `boundaries`, the states kept), each yielded as a `Prompt` and read in
        the batch's next pass beside the others' (`Batch.step`); `progress(done, total)` after each
        (it raises `Cancelled` once the client has gone). Returns the prompt's last logits."""
        cuts = segment_cuts(len(ids), session.segment, boundaries)
        arr = np.asarray(ids, dtype=np.int64)
        last = None
        for a, b in zip([0, *cuts[:-1]], cuts, strict=True):
            got = yield Prompt(session, arr[a:b], b == len(ids))
            if got is None:  # dropped: the client went away while it waited
                raise Cancelled
            last = got[0]
            progress(b, len(ids))
        return last

    def _solo_drafts(
        self, job: Job, session, steps, drafting: bool, start: int, pick: Picker, eos: int, observer: Observer
    ) -> _SoloDrafts:
        """A choice's `steps` (its first `Runtime.generate` call, `drafting` or batched) as a
        `_SoloDrafts`: its later calls draft (alone) or go on in the batch's passes, from the token
        handed over; it may draft only while no other choice of the request decodes or is to start."""
        rt = self.rt
        return _SoloDrafts(
            steps, drafting, start,
            drafts=lambda tok, n: rt.generate(
                session, [tok], job.max_tokens - n, pick, (eos,), speculate=job.speculate, uniforms=pick.rng),
            batched=lambda tok, n, logits, t: rt.generate(
                session, [tok], job.max_tokens - n, pick, (eos,), logits=logits, batched=True, speculate="off",
                uniforms=pick.rng, prompt_read=t),
            single=lambda: job.decoding == 1,
            observer=observer,
        )  # fmt: skip

    def _claim(self) -> bool:
        """Whether the batch has a place for one more row (a request's next choice), taking it if so."""
        if self.places >= self.max_batch:
            return False
        self._extra += 1
        return True

    @property
    def places(self) -> int:
        """The batch's places in use: one per running request, one more per extra choice of a
        request decoding at once (`n` > 1)."""
        return len(self._live) + self._extra

    def _first_choice(
        self, job: Job, steps, session, ids: list[int], got: list[int], kept: list, first_token: Callable[[], None]
    ) -> Generator[Step, tuple | None, Outcome]:
        """Choice 0 from `steps` (its `Runtime.generate`, the prompt's prefill first): each token
        pushed to the reply and fed in the batch's passes; then the states it keeps."""
        pick, live = job.pickers[0], job.live
        try:
            tok = next(steps, None)
            while tok is not None:
                if not got:
                    first_token()
                if live is not None:
                    job.emit("sample", self.stats.token(live, first=not got))
                got.append(tok)
                self._push(job, 0, tok)
                if job.reply.stopped or job.cancelled.is_set() or session.stop_reason != "interrupted":
                    break  # (a stop reason is set once `generate` has yielded its last token)
                tok = yield from self._next(steps, session, tok)
        except StopIteration:
            pass
        finally:
            steps.close()  # the session's record of this call is complete
            job.decoding -= 1
        job.usage.completion_tokens += len(got)
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
        return self._finish(job, 0, "stop" if got and got[-1] == job.reply.eos and pick.complete else "length")

    def _picker(self, job: Job, i: int) -> Picker:
        seed = job.params.seed
        # position-keyed draws (`engine.spec_draws`): the same ids for a seed with or without drafts
        rng = PositionUniforms(seed if i == 0 or seed is None else [seed, i])
        constraint = None
        if job.controls.grammar is not None and job.grammars is not None:
            constraint = job.grammars.constraint(job.controls.grammar, job.thinking)
        think_end = job.grammars.think_end if job.grammars is not None else None
        p = Picker(job.controls, job.params, self.n_ids, rng, self.banned, job.max_tokens, constraint, job.thinking,
                   think_end)  # fmt: skip
        job.pickers.append(p)
        return p

    def _push(self, job: Job, i: int, tok: int) -> None:
        reply = job.replies[i]
        if job.controls.top_logprobs is not None and tok != reply.eos and not reply.in_reasoning:
            entry = job.pickers[i].logprobs[-1]  # of the answer's text: reasoning has none (as DeepSeek's API)
            job.logprobs.setdefault(i, []).append(entry)
            job.lp_unsent.setdefault(i, []).append(entry)
        delta = reply.push(tok)
        if delta:
            delta.index = i
            delta.logprobs = job.lp_unsent.pop(i, [])
            job.emit("delta", delta)

    def _finish(self, job: Job, i: int, reason: str) -> Outcome:
        last, outcome = job.replies[i].finish(reason)
        outcome.index = i
        outcome.logprobs = job.logprobs.get(i, [])
        last.logprobs = job.lp_unsent.pop(i, [])
        if last:
            last.index = i
            job.emit("delta", last)
        job.emit("finish", outcome)
        return outcome

    def _more(
        self,
        job: Job,
        i: int,
        ids: list[int],
        state: SessionState,
        logits: np.ndarray | None,
        turns: list[Turn],
        claimed: bool,
    ) -> Generator[Step, tuple | None, Outcome]:
        """Choice i > 0 from the first choice's state at the end of the prompt `ids` and its logits there,
        through `Runtime.generate` as the first: timed by its session (its record joins `turns`),
        its tokens fed in the batch's passes (beside the first's and the other choices'), stopped
        at --ctx. `claimed`: it took a place of the batch (`_claim`), given back at its end (else it
        runs in the request's own place, no other choice of it running)."""
        try:
            return (yield from self._choice(job, i, ids, state, logits, turns))
        finally:
            if claimed:
                self._extra -= 1

    def _choice(
        self, job: Job, i: int, ids: list[int], state: SessionState, logits: np.ndarray | None, turns: list[Turn]
    ) -> Generator[Step, tuple | None, Outcome]:
        if logits is None:
            raise InternalError("the first choice kept no logits of the prompt's end")
        rt = self.rt
        session = rt.session(on_route=self.stats.on_route)
        session.restore(state)
        pick, reply = self._picker(job, i), job.replies[i]
        got: list[int] = []
        eos = (reply.eos,)
        steps = rt.generate(
            session, [], job.max_tokens, pick, eos, logits=logits, batched=self.batched,
            speculate=job.speculate, uniforms=pick.rng,
        )  # fmt: skip
        if self._may_draft(job):
            # decodes in the batch's passes, and drafts once it is the request's last choice and
            # the request is alone (as the first does); its drafter goes on from the first's at the
            # prompt's end (the prompt's taps) and sees its passes from its first token on
            begun = job.drafter_at_prompt_end
            drafter = (
                rt.speculator.adopt(session, begun.copy()) if begun is not None else rt.speculator.drafter(session)
            )
            observer = Observer(session, drafter)
            session.trace = observer
            steps = self._solo_drafts(job, session, steps, False, len(ids), pick, reply.eos, observer)
        try:
            tok = next(steps, None)
            while tok is not None:
                got.append(tok)
                if job.live is not None:
                    self.stats.token(job.live, first=False)
                self._push(job, i, tok)
                if reply.stopped or job.cancelled.is_set() or session.stop_reason != "interrupted":
                    break
                tok = yield from self._next(steps, session, tok)
        except StopIteration:
            pass
        finally:
            steps.close()
            job.decoding -= 1
            turns.append(session.turn)
        job.usage.completion_tokens += len(got)
        if got:
            self.ram.remember(ids + got)
        if job.cancelled.is_set():
            raise Cancelled
        return self._finish(job, i, "stop" if got and got[-1] == reply.eos and pick.complete else "length")


class _SoloDrafts:
    """Choice 0 of a batching server's request that may draft (its `speculate` not off): its
    `Runtime.generate` call drafts while the request is alone in flight (unbatched: it feeds its
    own tokens, several a pass) and steps its tokens in the batch's plain passes while others are.
    `Worker._next` hands it over at a token boundary, both ways, each time closing the call after
    the token it yielded (which leaves the session holding what comes before it: `generate`'s
    rule) and starting one of the other kind from that token; the token is fed in the next pass
    either way, so a hand-over costs no token and no pass:
    - `to_batched` (another request in flight or waiting): at the first boundary where the session
      holds no token past the one yielded (the picks of a verification pass that kept its drafts are
      handed on first: they need no pass, and closing before them would feed the session again), the
      token goes in the batch's next pass, beside the others' (the newcomer's first prompt segment),
      and a batched call goes on from that pass's logits (after a rejection, the tokens the drafting
      call carried go in that pass before the token: it is ended by `engine.speculate.HandOver`,
      which hands them back unfed);
    - `to_drafting` (alone `SETTLE` boundaries in a row): a drafting call feeds the token as its
      one-token prompt, which its drafter observes, then drafts as a request taken alone. The
      drafter goes on from where it was: while batched, the session's trace is `observer`
      (`engine.speculate.Observer`), which hands it each batched pass's taps.
    Greedy and seeded ids do not change (draws keyed by position: `engine.spec_draws`). Each call
    keeps its own record (`Turn`, its `speculation` counts for a drafting one), so the request's
    tokens are those of its calls' records summed; `turns` holds the records of the calls closed."""

    def __init__(
        self,
        gen,
        drafting: bool,
        start: int,
        drafts: Callable[[int, int], Generator],
        batched: Callable[[int, int, np.ndarray, float], Generator],
        single: Callable[[], bool],
        observer=None,
    ) -> None:
        self.gen, self.drafting, self.yielded = gen, drafting, 0
        self.start = start  # the first token's position (the prompt's length)
        # drafts(tok, n) / batched(tok, n, logits of tok's pass, when it began): the call after the
        # n tokens yielded, the last of which is tok
        self._drafts, self._batched = drafts, batched
        self.single = single  # no other choice of the request is decoding or still to start
        self.observer = observer  # the session's trace while batched: the drafter's taps
        self.quiet = 0  # boundaries in a row it was alone at, batched
        self.turns: list[Turn] = []

    def __iter__(self):
        return self

    def __next__(self) -> int:
        tok = next(self.gen)
        self.yielded += 1
        return tok

    def send(self, fed) -> int:
        tok = self.gen.send(fed)
        self.yielded += 1
        return tok

    def close(self) -> None:
        self.gen.close()

    def _end_call(self, session) -> None:
        self.gen.close()
        self.turns.append(session.turn)

    def _hand_over(self, session) -> list[int]:
        """Ends the drafting call at the token it yielded last (`engine.speculate.HandOver`): the
        tokens it carried, not fed (the caller feeds them before that token)."""
        try:
            self.gen.throw(HandOver())
        except StopIteration as e:
            carry = list(e.value or [])
        else:
            raise InternalError("a drafting call went on after it was handed over")
        self.turns.append(session.turn)
        return carry

    def verified_ahead(self, session) -> bool:
        """Whether the drafting call has fed the session past the token it yielded last (a verification
        pass kept its drafts, handed on one by one): the tokens up to the pass's last pick come with no
        pass, and closing the call before them would feed the session again up to that token."""
        return session.pos > self.start + self.yielded - 1

    def to_batched(self, tok: int, session) -> Generator[Step | Prompt, tuple | None, int | None]:
        """The token after `tok` once `tok` went in the batch's next pass (None: dropped, its client
        gone), with the tokens the drafting call carried after a rejected draft before it (one
        row each: a decode step that feeds them too, `Prompt.step`)."""
        carry = self._hand_over(session)
        self.drafting, self.quiet = False, 0
        session.trace = self.observer
        if carry:
            fed = yield Prompt(session, np.asarray([*carry, tok], dtype=np.int64), True, step=True)
        else:
            fed = yield Step(session, tok)
        if fed is None:
            if carry:  # the session holds every token before `tok`, as `generate` leaves it
                session.prefill(np.asarray(carry, dtype=np.int64))
            return None
        logits, wall, _ = fed
        self.gen = self._batched(tok, self.yielded, logits, time.perf_counter() - wall)  # its record: that pass
        return next(self, None)

    def settled(self, alone: bool) -> bool:
        """Whether a batched request goes back to drafting at this boundary: alone at `SETTLE` in a row."""
        self.quiet = self.quiet + 1 if alone else 0
        return self.quiet >= SETTLE

    def to_drafting(self, tok: int, session) -> int | None:
        """The token after `tok`, fed by a drafting call."""
        self._end_call(session)
        self.drafting, self.quiet = True, 0
        session.trace = None  # the drafting call's own taps from here
        self.gen = self._drafts(tok, self.yielded)
        return next(self, None)
