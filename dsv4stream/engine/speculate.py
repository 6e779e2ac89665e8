"""Speculative decoding: a drafter proposes tokens, the main model checks them in one pass.

Owns: `speculative_generate`, the generation loop of `Session.generate` with drafts (same
arguments, same yields, same stop rules, same `Turn` record plus `Turn.speculation`), the
`Drafter` protocol it drives, `Observer` (the drafter fed by passes it does not drive: a batching
server's), `HandOver` (leaving a drafting call without feeding what it carried), and
`parse_setting` (`--speculate auto|off|N`). The drafter (`engine.speculate_v41.DSparkDrafter`, or
a stand-in for benches) and the policy that picks each cycle's draft length (`engine.spec_policy`)
come from the caller.

One cycle, with t the picked token not yet fed and d_0..d_{k-1} its drafts (k = 0: a plain step):
1. snapshot the session; feed [t, d_0..d_{k-1}] in one pass (its logits rows r_0..r_k);
2. for j = 0, 1, ...: pick x_j from r_j with the caller's pick function (every sampling control,
   in the same order, on the same state as without drafts, since the state has seen exactly the
   tokens kept so far), at position P + 1 + j, and keep it; go on while x_j == d_j;
3. if fewer than k + 1 tokens were kept, restore the snapshot; the kept ones (t, d_0..d_{a-1})
   open the next cycle's pass, before its token and drafts (one pass, not a re-feed pass and a
   verification pass: the trunk and the experts are read once for both). The snapshot is taken
   before those carried tokens, so a rejection in that pass carries them again: once the carry
   is longer than a block plus one it is fed in a pass of its own (bounded passes). Whenever the caller
   holds a yielded token (the reply ended, or it closed the generator) the session holds exactly
   what a run without drafts holds: every token before it, fed.
Picking x_j and keeping d_j only when x_j == d_j is standard speculative sampling with a drafter
that proposes one token d (q = its point mass): it is accepted with probability p(d) = min(1, p/q),
and when it is not, x_j is distributed as p less d, renormalised: the residual max(0, p - q). With
the pick's uniform at position P + 1 + j fixed by the seed (`engine.spec_draws`), x_j does not
depend on the draft at all: a seed gives the same ids whatever the draft lengths (N, `auto`'s
choices, the budget), and greedy ids equal those without drafts: each row of a k + 1-token pass
carries the bits of a one-token pass at its position (the kernels compute a row from its own
inputs, and a window is read in position order: `model.cache.WindowCache.with_new`), which
tests/test_speculate_wide.py checks on a checkpoint wide enough for the fast kernels.

A cycle with k = 0 may carry a watch (`--speculate auto` learning the acceptance cheaply,
`engine.spec_policy`): the drafter proposes w tokens after t, nothing is fed but t, and the
drafts are compared with the tokens picked in this and the next cycles (x_j == d_j, the test a
verification applies; the picks do not depend on drafts, so a watch cannot change an id). A
drafter that can (`propose_rows`: the DSpark drafter's head input rows) leaves a watch's head to
the cycle's one-token pass, whose head call multiplies its rows with the main model's: the head,
the drafter's largest product, is read once for both (a few rows cost a head read where one
does: on demo-v41's BF16 head 9.9 ms for two rows, 10.0 for one; where the head is on a GPU
the run keeps its own call). The policy is told each cycle's cost against `off` (`settled`) for
its ledger.

The drafter sees the main model's taps (the V4.1 stack's "input" trace of its target layers) of
the kept positions only: those of a verification pass's kept prefix (causal: equal to a pass of
the prefix alone, up to rounding). A session whose drafter state does not end at the position
before the session's (a restored state, a chat turn after a stop) starts the drafter afresh.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Protocol

import numpy as np

from .. import kernels
from ..errors import UsageError
from .phases import StepClock, Turn
from .spec_stats import SpecCounts

F32 = np.float32
OFF, AUTO = "off", "auto"


def parse_setting(value: object, most: int | None = None, where: str = "--speculate") -> str | int:
    """`auto`, `off` or a draft length N >= 1 (0 = off); UsageError naming `where` otherwise."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v in (AUTO, OFF):
            return v
        try:
            value = int(v)
        except ValueError:
            raise UsageError(f"{where} {value!r}: give auto, off or a draft length like 3") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{where} {value!r}: give auto, off or a draft length like 3")
    if value < 0:
        raise UsageError(f"{where} {value}: give auto, off or a draft length of 1 or more")
    if value == 0:
        return OFF
    if most is not None and value > most:
        raise UsageError(f"{where} {value}: this checkpoint's drafter drafts at most {most} tokens")
    return value


class Drafter(Protocol):
    """The drafter beside one session (`reset` whenever the session's positions jump)."""

    targets: tuple[int, ...]  # main layers whose "input" streams it reads (none: no taps)
    block: int  # most drafts per cycle
    last: int  # the last main position it has observed (-1: none)

    def reset(self) -> None: ...

    def observe(self, taps: Sequence[np.ndarray], positions: np.ndarray) -> None:
        """The main model's streams entering each target layer at `positions` (T,), as they are:
        (T, hc, D) per layer of `targets`."""
        ...

    def propose(self, token: int, k: int) -> tuple[list[int], list[float]]:
        """k draft ids after `token` (picked at position last + 1) and each one's raw confidence."""
        ...


class Policy(Protocol):
    def most(self, kmax: int) -> int: ...

    def cut(self, confidence: Sequence[float], kmax: int) -> int: ...

    def watch(self, kmax: int, remaining: int | None = None, cold: bool = False) -> int: ...

    def watched(self, k: int, accepted: int, confidence: Sequence[float]) -> None: ...

    def settled(self, seconds: float, tokens: int) -> None: ...

    def overhead(self, verified: bool, seconds: float) -> None: ...

    def passed(self, n: int, seconds: float, read_bytes: int, read_seconds: float) -> None: ...

    def drafted(self, seconds: float, cold: bool = False, run: float | None = None) -> None: ...

    def verified(self, k: int, accepted: int, confidence: Sequence[float]) -> None: ...


class _Taps:
    """The session's trace while drafting: the "input" streams of the drafter's target layers,
    as they are ((T, hc, D) per layer), of the passes since `clear`; any trace the session had
    still runs. A pass of at most `keep` rows is kept whole: a cycle's pass (up to a block plus
    one carried tokens, the token and a block of drafts) must hand the drafter the rows of its
    kept prefix, the first ones; a longer one (a prefill) keeps its last `keep` rows, each
    segment its tail, so that the last `keep` rows held are contiguous: at least the window the
    drafter reads. Copies only: the mean over the hc copies is the drafter's to take when it runs
    (`DSparkDrafter`), so a cycle that drafts nothing pays a copy of a few KB per layer, not a
    reduction (three of them cost ~65 us a token in a pass on demo-v41, its caches cold from the
    kernels: 0.2 % of a step)."""

    def __init__(self, targets: Sequence[int], keep: int, inner) -> None:
        self.targets, self.keep, self.inner = tuple(targets), keep, inner
        self.rows: dict[int, list[np.ndarray]] = {t: [] for t in self.targets}
        self.fed = 0  # rows fed since `clear` (counted at the first target layer)

    def __call__(self, what: str, layer: int, x: np.ndarray) -> None:
        if self.inner is not None:
            self.inner(what, layer, x)
        if what == "input" and layer in self.rows:
            if layer == self.targets[0]:
                self.fed += x.shape[0]
            self.rows[layer].append(x[-self.keep :].copy())  # (the stack may reuse x's buffer)

    @property
    def reads_outputs(self) -> bool:
        """The taps read only the streams entering layers, which the last layer's row skip
        leaves whole (`Session._rows_used`); an inner trace may read more."""
        return self.inner is not None and getattr(self.inner, "reads_outputs", True)

    def clear(self) -> None:
        for v in self.rows.values():
            v.clear()
        self.fed = 0

    def take(self, n: int) -> tuple[np.ndarray, ...]:
        """Per target layer (n', hc, D): the rows of positions n - n' .. n - 1 of those fed since
        `clear` (0-based), n' = n where every row was kept (a cycle's pass: a verification's
        kept prefix), else the last of them held (a prefill's last `keep` rows at most)."""
        per = [r[0] if len(r) == 1 else np.concatenate(r) for r in (self.rows[t] for t in self.targets)]
        held = per[0].shape[0]
        if held == self.fed:
            return tuple(p[:n] for p in per)
        tail = min(held, self.keep)  # the contiguous rows: positions fed - tail .. fed - 1
        upto = tail - (self.fed - n)  # of them, those before n
        return tuple(p[held - tail : held - tail + max(0, upto)] for p in per)


def speculative_generate(
    session,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    pick: Callable[[np.ndarray], int],
    drafter: Drafter,
    policy: Policy,
    *,
    setting: str | int = AUTO,
    uniforms=None,
    stop_ids: Collection[int] = (),
    max_pos: int | None = None,
    progress: Callable[[int], None] | None = None,
    on_layer=None,
    boundaries: Collection[int] = (),
    logits: np.ndarray | None = None,
    spans=None,
) -> Iterator[int]:
    """`Session.generate` with drafts (see the module docstring): the same arguments and yields;
    `uniforms` (`PositionUniforms`, the one the pick draws from) is moved to each pick's position.
    As there, every yielded token but the last has been fed; a caller that closes the generator
    mid-pass gets the session put back to that rule."""
    if logits is not None and len(prompt_ids):
        raise UsageError("generate: give the prompt ids or the logits to continue from, not both")
    engine = session.engine
    t0 = time.perf_counter()
    turn = session.turn = Turn()
    spec = turn.speculation = SpecCounts(setting=str(setting))
    remembered = getattr(policy, "remembered", None)  # auto's figures from earlier runs (`spec_memory`)
    spec.remembered_runs = remembered.runs if remembered is not None else 0
    engine.phases.turns.append(turn)
    meter = engine.meter
    clock = StepClock(_Readings(meter))  # a pass's reads from the readings its clock takes (no more meter calls)
    gov, threads = getattr(engine, "governor", None), 0  # decode threads chosen by timing (`engine/threads.py`)
    inner = session.trace
    # a cycle's longest pass: up to a block plus one carried tokens, the token and a block of drafts
    taps = _Taps(drafter.targets, max(2 * (drafter.block + 1), getattr(drafter, "window", 1)), inner)
    session.trace = taps if drafter.targets else inner
    session.stop_reason = "interrupted"
    mark = meter() if logits is not None else None
    fresh = drafter.last != session.pos - 1

    def at(pos: int) -> None:
        if uniforms is not None:
            uniforms.at(pos)

    def observe(n: int, start: int, skip: int = 0) -> None:
        """The drafter sees n rows of the taps collected (after the first `skip`), positions start.."""
        if drafter.targets and n:
            rows = taps.take(skip + n)
            if skip:
                rows = tuple(r[skip:] for r in rows)
            got = rows[0].shape[0]
            drafter.observe(rows, np.arange(start + n - got, start + n, dtype=np.int64))
        else:
            drafter.last = start + n - 1

    try:
        if logits is None:
            start = session.pos
            if fresh:
                drafter.reset()
            logits = session._timed_prefill(turn, t0, prompt_ids, progress, on_layer, boundaries, spans)
            mark = meter()
            observe(session.pos - start, start)
        elif fresh:
            drafter.reset()
            drafter.last = session.pos - 1
        if max_new_tokens <= 0:
            session.stop_reason = "gen_limit"
            return
        at(session.pos)
        tok = pick(logits)
        if turn.prompt_tokens is not None:
            turn.first_token_seconds = time.perf_counter() - t0
        turn.tokens.append(tok)
        done = 1
        stop = _stop(tok in stop_ids, max_pos is not None and session.pos >= max_pos, done == max_new_tokens)
        carry: list[int] = []  # kept tokens not fed yet (after a rejection): they open the next pass
        watch: _Watch | None = None  # a watch's drafts not all compared yet
        fold = None  # a watch's run whose head rows go into the next pass (`Drafter.propose_rows`)
        heads = _HeadTime()
        while True:
            if stop is not None:
                session.stop_reason = stop
                yield tok
                return
            # the next cycle's drafts, and its pass's reads started, before tok is handed on
            c0 = time.perf_counter()
            p0 = session.pos + len(carry)  # tok's position
            kmax = min(drafter.block, max_new_tokens - done - 1, max_pos - p0 - 1 if max_pos is not None else 1 << 30)
            k = policy.most(max(0, kmax))
            drafts: list[int] = []
            conf: list[float] = []
            spent = 0.0  # the drafter's seconds this cycle
            cold = bool(getattr(drafter, "cold", False))  # the process's first drafter run (warming up)
            if k == 0 and watch is None and (w := policy.watch(max(0, kmax), max_new_tokens - done - 1, cold)) > 0:
                # a watch: drafts compared with the next picks, never fed (their ids cannot change)
                if not carry and hasattr(drafter, "propose_rows") and session.folds_rows():
                    # its head rows go into this cycle's one-token pass's head call: the head (the
                    # drafter's largest product) is read once for both
                    fold = drafter.propose_rows(tok, w)
                    spec.watch_drafted += w
                else:
                    watch = _Watch(*drafter.propose(tok, w))
                    spec.watch_drafted += len(watch.drafts)
                    if not watch.drafts:  # (a stand-in near the end of its script)
                        watch = None
                spent = time.perf_counter() - c0
                spec.watches += 1
            elif k > 0:
                drafts, conf = drafter.propose(tok, k)
                spent = time.perf_counter() - c0
            if spent:
                if fold is None:  # (a folded watch's cost is known after its pass)
                    policy.drafted(spent, cold)
                spec.draft_seconds += spent
                turn.decode_seconds += spent  # decode time is every pass's and the drafter's
                turn.profile["other"] += spent
            if k > 0:
                k = min(policy.cut(conf, k), k)
                drafts = drafts[:k]
            off = len(carry)
            fed = [*carry, tok, *drafts]
            session.read_ahead(fed)
            before = time.perf_counter() - c0  # the cycle's seconds before the pass (the drafter's included)
            spec.seconds += before
            try:
                yield tok
            except GeneratorExit:  # the caller keeps tok: the session holds what is before it
                if carry:  # (the drafter saw their taps in the pass that kept them)
                    session.prefill(np.asarray(carry, dtype=np.int64))
                raise
            except HandOver:  # the caller feeds the carried tokens, then tok
                return carry
            c0 = time.perf_counter()
            snap = session.snapshot() if k else None
            plain = len(fed) == 1
            if gov is not None:  # a one-token pass at the count the governor tries; longer ones at all
                want = gov.next_threads() if plain else gov.most
                if want != threads:
                    threads = want
                    kernels.set_threads(threads)
            rows, wall, phases, more, folded = _pass(
                session, clock, taps, fed, turn, policy, spec, heads, None if fold is None else fold.rows
            )
            if fold is not None:  # the watch's drafts from its rows' logits
                # charged what it added (its stages, the head's time beyond a plain pass's); a
                # drafting run pays a head call of its own, so that is its cost to learn from
                alone = heads.seconds if heads.seconds is not None else phases["head"]
                policy.drafted(spent + more, cold, run=spent + alone)
                spent += more
                spec.draft_seconds += more
                watch = _Watch(*fold.finish(folded))
                fold = None
            if gov is not None and plain:
                gov.record(threads, wall - phases["expert_reads"] - phases["trunk_reads"])
            outs: list[int] = []
            t_pick = time.perf_counter()
            for j in range(k + 1):
                at(p0 + 1 + j)
                x = pick(rows[off + j])
                outs.append(x)
                done += 1
                stop = _stop(x in stop_ids, max_pos is not None and p0 + 1 + j >= max_pos, done == max_new_tokens)
                if stop is not None or j == k or x != drafts[j]:
                    break
            turn.profile["sampler"] += time.perf_counter() - t_pick
            accepted = sum(1 for j, x in enumerate(outs) if j < k and x == drafts[j])
            if k:
                policy.verified(k, accepted, conf)
                spec.verify_passes += 1
                spec.drafted += k
                spec.accepted += accepted
                spec.verified_tokens += k + 1
            else:
                spec.steps += 1
            spec.lengths[k] += 1
            spec.cycles += 1
            spec.tokens += len(outs)
            spec.refeed_tokens += off
            observe(len(outs), p0, skip=off)  # positions p0.. (tok and the drafts kept)
            if watch is not None and any(watch.compare(x) for x in outs):
                policy.watched(len(watch.drafts), watch.right, watch.confidence)
                spec.watch_accepted += watch.right
                watch = None
            carry = []
            if off + len(outs) < len(fed):  # a rejection (or a stop inside the pass): back to the kept tokens
                session.restore(snap)
                carry = fed[: off + len(outs)]
                spec.refeeds += 1
                # the snapshot was taken before the carry, so a rejection drops the carry too:
                # fed again now once it is longer than a block, or every rejection in a row
                # would lengthen the next pass by a token (a pass of 60 tokens after 60)
                if stop is not None or len(carry) > drafter.block + 1:  # (a stop: the session must hold them now)
                    wall += _pass(session, clock, taps, carry, turn, policy, spec, heads)[1]
                    spec.refeed_tokens += len(carry)
                    carry = []
            # the cycle's own work outside its passes and drafter run (snapshot, restore, picks, taps)
            policy.overhead(k > 0, max(0.0, before + time.perf_counter() - c0 - spent - wall))
            if not plain or spent:  # drafted, watched or fed carried tokens: what it cost against off
                policy.settled(spent + (0.0 if plain else wall), 0 if plain else len(outs))
            turn.tokens.extend(outs)
            turn.decode_steps += len(outs)  # one per token fed: as many as without drafts
            after = time.perf_counter() - c0
            spec.seconds += after
            if plain and not spent:  # a cycle as off runs one: the estimate without drafts
                spec.plain_seconds += before + after
                spec.plains += 1
            i = 0
            try:
                for i, x in enumerate(outs[:-1]):
                    yield x
            except (GeneratorExit, HandOver) as e:  # the caller stopped at outs[i]: feed only what comes before it
                session.restore(snap)
                del turn.tokens[len(turn.tokens) - len(outs) + i + 1 :]
                if isinstance(e, HandOver):  # (the caller feeds them)
                    return list(fed[: off + 1 + i])
                session.prefill(np.asarray(fed[: off + 1 + i], dtype=np.int64))
                raise
            tok = outs[-1]
    finally:
        if gov is not None and threads not in (0, gov.most):
            kernels.set_threads(gov.most)  # prefills keep every thread
        session.trace = inner
        turn.close(session.stop_reason, t0, meter, mark)
        if mark is not None:
            spec.expert_bytes = turn.decode_expert_bytes


class HandOver(Exception):
    """Thrown into `speculative_generate` at a token it yielded (`generator.throw`): it ends there
    without feeding the tokens it carried after a rejected draft, and returns them (its
    StopIteration's value; none carried: []): the caller feeds them, then the token it holds, in
    one pass (a batching server's request leaving drafting for the batch's passes). Closing it
    instead (`close`) feeds them in a pass of their own."""


class Observer:
    """A session's trace while its drafter does not drive it (a batching server's request in
    the batch's passes, `engine.batch`): the streams entering the drafter's target layers in each
    pass go to the drafter (`Drafter.observe`), so that when the request drafts again its window
    holds the positions before it, as if it had drafted all along, instead of starting afresh.
    A drafter that has not observed the position before a pass's first starts afresh there; one
    that has observed some of the pass's positions (a drafting call's carried tokens) takes the rest."""

    reads_outputs = False  # the streams entering layers only: the last layer's row cut stays

    def __init__(self, session, drafter: Drafter) -> None:
        self.session, self.drafter = session, drafter
        self.targets = tuple(drafter.targets)
        self.keep = max(1, getattr(drafter, "window", 1))  # the most rows a drafter reads
        self.rows: dict[int, np.ndarray] = {}

    def __call__(self, what: str, layer: int, x: np.ndarray) -> None:
        if what != "input" or layer not in self.targets:
            return
        self.rows[layer] = x[-self.keep :].copy()
        if len(self.rows) < len(self.targets):
            return
        rows, self.rows = tuple(self.rows[t] for t in self.targets), {}
        start = self.session.pos  # the pass's first position (the session moves on after the pass)
        end = start + x.shape[0]
        if not start - 1 <= self.drafter.last < end:  # a gap, or a drafter ahead of the session
            self.drafter.reset()
        # positions it has seen already (tokens a drafting call carried, fed here with the next
        # one: their taps came from the pass that kept them) are not observed twice
        new = min(end - max(self.drafter.last + 1, start), rows[0].shape[0])
        if new > 0:
            self.drafter.observe(tuple(r[-new:] for r in rows), np.arange(end - new, end, dtype=np.int64))


class _Watch:
    """A watch's drafts (`spec_policy`): compared one by one with the tokens picked after it."""

    def __init__(self, drafts: list[int], confidence: list[float]) -> None:
        self.drafts, self.confidence, self.right = drafts, confidence, 0

    def compare(self, picked: int) -> bool:
        """Count `picked` against the next draft; True once the watch is over (a wrong draft, or all right)."""
        if picked != self.drafts[self.right]:
            return True
        self.right += 1
        return self.right == len(self.drafts)


class _Readings:
    """The engine's meter, keeping its last two readings: a pass's reads are the difference of
    the two its `StepClock` took (`off`'s loop reads the meter twice a step, and so does a plain
    cycle here)."""

    def __init__(self, meter) -> None:
        self.meter, self.before, self.after = meter, None, None

    def __call__(self):
        self.before, self.after = self.after, self.meter()
        return self.after


class _HeadTime:
    """The head's seconds in one-token passes of the main model's own row (a mean over the last
    few): a watch whose rows went into a pass's head call added that pass's head time beyond it,
    and a drafter run with a head call of its own pays about it (one or a few rows: the head's
    read, not its arithmetic)."""

    def __init__(self) -> None:
        self.seconds: float | None = None

    def add(self, seconds: float) -> None:
        self.seconds = seconds if self.seconds is None else 0.75 * self.seconds + 0.25 * seconds


def _pass(
    session,
    clock: StepClock,
    taps: _Taps,
    ids: list[int],
    turn: Turn,
    policy,
    spec: SpecCounts,
    heads: _HeadTime,
    fold: np.ndarray | None = None,
):
    """One main-model pass of `ids`, timed into the turn, the figures and the policy: its logits
    rows, its wall seconds and its seconds by phase, what `fold` added and its rows' logits (None
    without). A one-token pass is
    `Session.step`, the call `off`'s loop makes (no segment cuts or per-layer hooks of a prefill);
    with `fold` (a watch's head rows, `Session.step_with_rows`) their logits follow its row, and
    the head's time beyond a plain pass's is the watch's: left out of the wall seconds returned
    and of what the policy and the figures time a one-token pass by."""
    taps.clear()
    clock.begin()
    theirs = None
    if fold is not None:
        own, theirs = session.step_with_rows(ids[0], fold)
        rows = own[None, :]
    elif len(ids) == 1:
        rows = session.step(ids[0])[None, :]
    else:
        rows = session.prefill(np.asarray(ids, dtype=np.int64))
    wall, spent = clock.end()
    more = 0.0
    if fold is not None:
        more = min(wall, max(0.0, spent["head"] - heads.seconds)) if heads.seconds is not None else 0.0
    elif len(ids) == 1:
        heads.add(spent["head"])
    c0, c1 = clock.meter.before, clock.meter.after
    turn.add_step(wall, spent)
    turn.decode_steps -= 1  # counted per token fed by the caller
    read = c1.expert_bytes_read - c0.expert_bytes_read
    policy.passed(len(ids), wall - more, read, c1.expert_read_seconds - c0.expert_read_seconds)
    if len(ids) == 1:
        spec.ones += 1
        spec.one_seconds += wall - more
    return rows, wall - more, spent, more, theirs


def _stop(eos: bool, context_full: bool, gen_limit: bool) -> str | None:
    if eos:
        return "eos"
    if context_full:
        return "context_full"
    return "gen_limit" if gen_limit else None
