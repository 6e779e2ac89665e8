"""How many tokens to draft before each verification pass: a fixed N, or `auto` from measured costs.

Owns: `FixedDrafts` (`--speculate N`) and `AutoDrafts` (`--speculate auto`), asked by
`engine.speculate` each cycle: `most(kmax)` before the drafter runs (0: no verified draft),
`cut(confidence, kmax)` once its per-slot confidence is known, and, where `most` gave 0,
`watch(kmax)`: how many drafts to propose only to compare with the tokens the main model picks
next (a watch: no pass feeds them). Told what happened by `passed(n, seconds, bytes,
read_seconds)` (a main-model pass of n tokens), `drafted(seconds)` (a drafter run),
`overhead(verified, seconds)` (each cycle's own seconds outside its passes and drafter run),
`verified(k, accepted, confidence)` (a verification pass), `watched(k, accepted, confidence)`
(a watch, once its drafts are compared) and `settled(seconds, tokens)` (what a cycle that drafted,
watched or fed carried tokens spent, and the tokens it picked: 0 for a watch's drafter run,
whose plain pass is off's).

`auto`'s model of one cycle that drafts k tokens (k = 0: a plain one-token step):
  cost(k)   = t_draft + t_extra + t(k + 1) + sum_{a<k} P(first reject at a) * (t(a + 2) - t(1))
  (after a rejection at a, the a + 1 kept tokens are fed again at the start of the next pass)
  tokens(k) = 1 + sum_{j=1..k} prod_{i<j} alpha_i
and it drafts the k in 0..kmax with the most tokens per second, tokens(k) / cost(k).
- t(n): the measured seconds of main-model passes of n tokens (a decaying mean per n, drawn
  up towards the fit below while it has few timings); t(1) is the one-token mean, or the fastest
  of the last `RECENT` one-token passes or a longer pass's mean where lower (while drafting no
  one-token pass is timed, and a one-token mean measured high early would make every extra token
  look free and credit drafts with steps they did not save); t(n > 1) is its own mean, never
  blended below it, and an n not yet measured is predicted from t(1) plus a jump plus a
  per-extra-token slope fitted to the multi-token passes so far (costs are concave: a second
  token costs most, on demo-v41 0.56 of a step, each further one 0.1-0.3); with one length timed
  the slope is a prior from what a one-token pass reads: every extra token may route to experts
  no other token of the pass uses, so it costs up to the bytes a one-token step reads (its
  misses) at the measured read rate, plus a share of its compute.
  While drafting pays, a draft one token longer than the best is tried once for each pass length
  not yet measured (predictions from shorter passes overestimate longer ones).
  While drafting, a plain step every `REMEASURE` passes times t(1) again (the one-token time it
  compares every draft with; the machine's load moves).
- t_extra: what a verifying cycle spends outside its pass and drafter run beyond a plain cycle
  (its snapshot, a restore after a rejection, k + 1 picks: 1-7 ms on demo-v41, 3-10 % of a
  step), measured once it has verified (a prior share of t(1) before); the ledger is charged it too.
- alpha_i: the acceptance of recent drafts, verified or watched (decaying counts of accepted
  drafts and first rejections: the geometric model's estimate), scaled per slot by the drafter's
  confidence head (sigmoid of its raw output) relative to the confidence of recent drafts.

It never makes a prompt slower than `off` beyond noise:
- It starts with plain steps (its prior acceptance is 0) and learns the acceptance by watching:
  the drafter proposes, nothing is verified, and its drafts are compared with the tokens the
  main model picks anyway (the same test a verification applies: a greedy or seeded pick does
  not depend on the drafts). A watch costs one drafter run and no pass; a verified probe cost a
  drafter run, a longer pass and a re-fed token, two to three steps when experts stream.
- An episode starts with a watch of one draft; while every draft of a watch is right the next
  cycle watches twice as many (up to a block), else as many. After each watch: verified drafts
  from the next cycle where drafting pays even at the low end of the acceptance (`SPREAD`
  phantom rejections added to the counts); the episode ends where even the high end (phantom
  acceptances) would not beat plain steps by `MIN_GAIN`, or after `MOST_WATCHES` watches, and the
  next one then waits twice as many plain cycles (4 .. 256; 4 again after an episode that paid).
  While drafting, a run of rejections that makes k = 0 best goes back to watching (cheap) as
  long as the high end could still pay.
- It keeps a ledger against `off`: every cycle that drafted, watched or re-fed carried tokens
  adds its seconds less t(1) per token it picked (re-fed tokens are charged, not credited
  again; credit is kept down to -SHARE of the time). A watch is charged before it runs: a new
  episode starts only while the ledger plus what a drafter run costs (measured) stays within
  `SHARE` of the decode time measured, and an episode watches on only while that stays within
  its bound below. The first watch of a policy is the run that measures the drafter's cost, so
  it is the one watch not charged ahead: a drafter that accepts nothing costs one drafter run
  per policy (one a `dsv4 run` or server, `engine.speculation`) and then SHARE of the time (on
  demo-v41 in RAM a drafter run costs 0.6-0.9 of a step: one watch in a 128-token reply, where
  charging the ledger only after a watch, and SHARE 1 %, allowed two). An episode
  ends once the ledger has grown by more than `GRACE` steps (`FIRST_GRACE` from its first
  verification where no multi-token pass was timed before: drafting on a prior) and SHARE of
  the time since it started (the model of the costs can be wrong; the ledger is what it cost).
- While no multi-token pass was timed, a verified draft is at most `FIRST_MOST` long: its cost
  is a prior until then, and at a streaming budget a longer pass reads the union of its
  tokens' experts (on demo-v41, 0.63 GB: a 6-token pass 161-198 ms against 72-76 for one).
- No episode starts where drafting would not pay even at an acceptance of `CEILING` with the
  costs measured (a budget where a verification's union of experts reads too much), nor where
  the reply has fewer than `HORIZON` drafter runs' worth of steps left (its lesson could not pay).
- What earlier runs measured (`remembered`: `engine.spec_memory` keeps it between runs) is a
  prior: the drafter run's cost per step charges the first watch ahead like any other, and the
  acceptance (at most `REMEMBERED_DRAFTS` drafts' worth) decides how the run starts (`_recall`):
  a drafter remembered to pay is checked by one watched draft and then drafts; one remembered
  never to pay is not watched before the ledger affords it (a short reply runs as `off`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

DECAY = 0.9  # per pass or drafter run timed: recent costs weigh most
COUNT_DECAY = 0.97  # per draft counted: the acceptance moves slowly, its estimate weighs ~30 drafts
MIN_GAIN = 0.1  # an episode watches on only while drafting could be this much faster than plain steps
PROBE_FIRST, PROBE_MOST = 4, 256  # cycles between watch episodes: the first, and the longest back-off
# the most auto may lose against off beside the drafter run that times the drafter, a share of
# the decode time it measured (0.5 %: with 1 % a drafter run of 0.6 step fitted twice in 128 tokens)
SHARE = 0.005
CEILING = 0.95  # the best acceptance a drafter is credited with when deciding whether to watch at all
SHRINK = 2.0  # a pass length's own mean counts against this many passes' worth of the fitted line
COMPUTE_SHARE = 0.25  # prior: an extra token of a pass costs this share of a step's compute
SPREAD = 1.0  # phantom drafts either way in the acceptance's range
MOST_WATCHES = 5  # an episode that has not decided after this many watches ends
GRACE = 8.0  # one-token steps an episode of verified drafting may lose before the ledger stops it
FIRST_GRACE = 4.0  # GRACE from the first verification of an episode that drafts before any multi-token pass was timed
RECENT = 8  # one-token passes whose fastest bounds t(1): a mean still carrying a slow start is stale
DRAFT_PRIOR = (
    0.5  # prior: a drafter run costs this share of a one-token pass (only whether to watch at all, before one is timed)
)
REMEASURE = 24  # passes while drafting before a plain step times t(1) again
FIRST_MOST = 2  # the longest draft verified while no multi-token pass was timed (its cost a prior)
EXTRA_PRIOR = 0.05  # prior: a verifying cycle's own work outside its pass (snapshot, restore, picks), per t(1)
# a new watch episode starts only while the reply has this many drafter runs' worth of one-token
# steps left (a drafter run of 0.6 step: 19 steps; 0.1 step, as a deep model's: 3)
HORIZON = 32.0
# what earlier runs measured (`Remembered`) weighs at most this many drafts in the acceptance: a
# prior that a few drafts of this run overturn (another prompt may suit the drafter less or more)
REMEMBERED_DRAFTS = 8.0
RUN_KEEP = 0.8  # what the memory keeps of earlier runs' counts each run that counted drafts (`remember`)
# every this many runs one remembered not to pay still gets its first watch free (`_recall`): a
# good drafter that an unlucky reply made look useless (2 first drafts wrong: 1 % at 90 % right) is
# not shut out of short replies for good
REVISIT = 8


class FixedDrafts:
    """`--speculate N`: N drafts every cycle (fewer where the reply or the context ends) but the
    first, a plain step: the one-token pass the figures' time without drafts is estimated from."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.first = True

    def most(self, kmax: int) -> int:
        if self.first:
            self.first = False
            return 0
        return min(self.n, kmax)

    def cut(self, confidence: Sequence[float], kmax: int) -> int:
        return min(self.n, kmax)

    def watch(self, kmax: int, remaining: int | None = None, cold: bool = False) -> int:
        return 0

    def passed(self, n: int, seconds: float, read_bytes: int, read_seconds: float) -> None:
        pass

    def drafted(self, seconds: float, cold: bool = False, run: float | None = None) -> None:
        pass

    def verified(self, k: int, accepted: int, confidence: Sequence[float]) -> None:
        pass

    def watched(self, k: int, accepted: int, confidence: Sequence[float]) -> None:
        pass

    def settled(self, seconds: float, tokens: int) -> None:
        pass

    def overhead(self, verified: bool, seconds: float) -> None:
        pass


@dataclass
class _Mean:
    """A decaying mean."""

    value: float = 0.0
    weight: float = 0.0

    def add(self, x: float) -> None:
        self.weight = self.weight * DECAY + 1.0
        self.value += (x - self.value) / self.weight

    @property
    def known(self) -> bool:
        return self.weight > 0


@dataclass(frozen=True)
class Remembered:
    """What earlier runs of `auto` measured with this drafter, checkpoint and machine
    (`engine.spec_memory` keeps it between runs): a warm drafter run's seconds per one-token
    pass, the counts of accepted drafts and first rejections, the mean confidence (sigmoid) of
    the drafts counted (None: none had one), how many runs it sums up, and a process's first
    drafter run's seconds per one-token pass (it warms kernels, caches and expert reads: the run
    a `dsv4 run` of one reply watches with, so the cost its first watch is charged)."""

    draft_share: float | None  # None: no warm drafter run was timed (only a process's first)
    accepted: float
    rejected: float
    confidence: float | None = None
    runs: int = 1
    cold_share: float | None = None  # a process's first drafter run per one-token pass (None: not timed)


@dataclass
class AutoDrafts:
    """`--speculate auto` (see the module docstring)."""

    block: int  # the drafter's most drafts per cycle
    remembered: Remembered | None = None  # what earlier runs measured: a prior, see `_recall`
    passes: dict[int, _Mean] = field(default_factory=dict)  # n tokens -> seconds
    draft_seconds: _Mean = field(default_factory=_Mean)  # warm drafter runs (not a process's first)
    cold_seconds: float = 0.0  # the process's first drafter run, where this policy timed it
    step_bytes: _Mean = field(default_factory=_Mean)  # expert bytes a one-token pass reads
    read_rate: _Mean = field(default_factory=_Mean)  # bytes per second of read time
    # decaying counts (none before the first watch: alpha 0, and its range 0 .. 1)
    accepted: float = 0.0
    rejected: float = 0.0
    conf_mean: _Mean = field(default_factory=_Mean)
    elapsed: float = 0.0  # decode seconds measured: every pass and drafter run
    ledger: float = 0.0  # seconds lost against off by the cycles that drafted, watched or carried
    idle: int = 0  # plain cycles since the last episode ended
    wait: int = PROBE_FIRST  # plain cycles before the next episode
    watching: int = 0  # drafts of the current episode's next watch (0: no episode)
    drafting: bool = False  # verified drafts while they pay
    # the ledger and the time measured when the episode started, and the steps it may lose
    opened_at: tuple[float, float, float] = (0.0, 0.0, GRACE)
    watches: int = 0  # watches of the current episode so far
    recent_t1: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # the last one-token passes' seconds
    since_t1: int = 0  # passes since the last one-token pass
    plain_other: _Mean = field(default_factory=_Mean)  # a plain cycle's seconds outside its pass
    verify_other: _Mean = field(default_factory=_Mean)  # a verifying cycle's outside its pass and drafter run
    # this run's own counts, not decayed: the decaying ones end where an episode stopped, after
    # a run of rejections, and would carry that low to the next run
    own_accepted: float = 0.0
    own_rejected: float = 0.0
    recalled: bool = False  # the remembered acceptance was weighed once t(1) was known (`_recall`)
    checking: bool = False  # the watch that checks the remembered acceptance is under way
    free: bool = False  # the next episode's first watch is not charged ahead (`_recall`)

    def __post_init__(self) -> None:
        r = self.remembered
        if r is None:
            return
        n = r.accepted + r.rejected
        scale = min(1.0, REMEMBERED_DRAFTS / n) if n > 0 else 0.0
        self.accepted, self.rejected = r.accepted * scale, r.rejected * scale
        if r.confidence is not None:
            self.conf_mean.add(r.confidence)

    # ---- what it measured -------------------------------------------------------------------
    def passed(self, n: int, seconds: float, read_bytes: int, read_seconds: float) -> None:
        self.elapsed += seconds
        self.passes.setdefault(n, _Mean()).add(seconds)
        self.since_t1 = 0 if n == 1 else self.since_t1 + 1
        if n == 1:
            self.step_bytes.add(read_bytes)
            self.recent_t1.append(seconds)
        if read_bytes and read_seconds > 0:
            self.read_rate.add(read_bytes / read_seconds)

    def drafted(self, seconds: float, cold: bool = False, run: float | None = None) -> None:
        """A drafter run's seconds; `cold`: the process's first (its kernels, caches and expert
        reads warming: 1.7x a later run in a script on demo-v41, 6x in a `dsv4 run` on a loaded
        machine), charged like any but not taken as what a run costs. `run`: what the run would
        have cost with a head call of its own, where its head rows went into a main pass's
        (a watch: `seconds` is what it added), the figure a drafting run's cost is learned from."""
        self.elapsed += seconds
        cost = seconds if run is None else run
        if cold:
            self.cold_seconds = max(self.cold_seconds, cost)
        else:
            self.draft_seconds.add(cost)

    def settled(self, seconds: float, tokens: int) -> None:
        if self._t1_known:
            # credit from drafts that paid is kept up to the bound's share: a run that gained
            # early does not buy unbounded watching later
            self.ledger = max(-SHARE * self.elapsed, self.ledger + seconds - tokens * self.t(1))

    def overhead(self, verified: bool, seconds: float) -> None:
        """A cycle's seconds outside its passes and drafter run; a verifying cycle's beyond a plain
        one's (its snapshot, a restore after a rejection, k + 1 picks) goes on the ledger."""
        (self.verify_other if verified else self.plain_other).add(seconds)
        if verified and self.plain_other.known and self._t1_known:
            self.ledger = max(-SHARE * self.elapsed, self.ledger + seconds - self.plain_other.value)

    def verified(self, k: int, accepted: int, confidence: Sequence[float]) -> None:
        self._count(k, accepted, confidence)

    def watched(self, k: int, accepted: int, confidence: Sequence[float]) -> None:
        self._count(k, accepted, confidence)
        if self.checking:
            self.checking = False
            if accepted == 0:  # the memory does not hold for this prompt: this run's count alone
                self.accepted, self.rejected = 0.0, 1.0
        if not self.watching:  # (an episode closed meanwhile)
            return
        self.watches += 1
        low, high = self._range()
        if self._could_pay(low, 0.0):  # pays even at the low end: verify drafts
            self.watching, self.drafting = 0, True
            if not self._multi_timed:
                # drafting on a prior of what a longer pass costs (none timed yet): where the prior
                # is wrong the ledger is the only check, so from here it may lose FIRST_GRACE steps
                self.opened_at = (self.ledger, self.elapsed, FIRST_GRACE)
        elif not self._could_pay(high, MIN_GAIN) or self.watches >= MOST_WATCHES or not self._affords(self.bound):
            self._close(paid=False)  # could not pay enough even at the high end (or never made up its mind)
        elif accepted == k:
            self.watching = min(self.block, 2 * k)  # every draft right: watch more next cycle

    def _count(self, k: int, accepted: int, confidence: Sequence[float]) -> None:
        self.own_accepted += accepted
        self.own_rejected += 1 if accepted < k else 0
        self.accepted = self.accepted * COUNT_DECAY**k + accepted
        self.rejected = self.rejected * COUNT_DECAY**k + (1 if accepted < k else 0)
        for c in confidence[:k]:
            self.conf_mean.add(_sigmoid(c))

    def _close(self, paid: bool) -> None:
        """End the episode: the next one waits PROBE_FIRST cycles after an episode that paid for
        itself (the ledger went down), twice the last wait otherwise."""
        self.watching, self.drafting, self.idle, self.watches = 0, False, 0, 0
        self.wait = PROBE_FIRST if paid else min(PROBE_MOST, 2 * self.wait)

    def remember(self) -> Remembered | None:
        """What this run measured, for the next (`engine.spec_memory`), on top of what it was
        given: the drafter's cost per one-token pass (measured, else the remembered one) and the
        acceptance counts: RUN_KEEP of the remembered ones plus this run's own where it counted
        drafts, else the remembered ones unchanged. None where neither is known."""
        r = self.remembered
        if self.draft_seconds.known and self._t1_known:
            share = self.draft_seconds.value / max(self.t(1), 1e-12)
        elif r is not None:
            share = r.draft_share
        elif self.counted or self.cold_seconds:
            share = None  # only a cold run timed: the next run times its own
        else:
            return None
        cold = r.cold_share if r is not None else None
        if self.cold_seconds and self._t1_known:
            cold = self.cold_seconds / max(self.t(1), 1e-12)
        acc, rej, conf = (r.accepted, r.rejected, r.confidence) if r is not None else (0.0, 0.0, None)
        if self.counted:
            keep = RUN_KEEP if r is not None else 0.0
            acc, rej = keep * acc + self.own_accepted, keep * rej + self.own_rejected
            conf = self.conf_mean.value if self.conf_mean.known else conf
        return Remembered(share, acc, rej, conf, (r.runs if r is not None else 0) + 1, cold)

    # ---- decisions ----------------------------------------------------------------------------
    @property
    def counted(self) -> bool:
        """Whether this run counted drafts (verified or watched): each count adds an accepted
        draft or a first rejection."""
        return self.own_accepted + self.own_rejected > 0

    @property
    def _t1_known(self) -> bool:
        return self.passes.get(1, _Mean()).known

    @property
    def _multi_timed(self) -> bool:
        """Whether a pass of more than one token was timed."""
        return any(n > 1 and m.known for n, m in self.passes.items())

    @property
    def alpha(self) -> float:
        n = self.accepted + self.rejected
        return self.accepted / n if n else 0.0

    def _range(self) -> tuple[float, float]:
        """The acceptance's low and high ends: `SPREAD` more rejections, or acceptances, than
        counted (a handful of watched drafts says little; the decaying counts weigh about 30)."""
        n = self.accepted + self.rejected + SPREAD
        return self.accepted / n, (self.accepted + SPREAD) / n

    @property
    def bound(self) -> float:
        """How far the ledger may go in an episode: where it stood when the episode started, plus
        SHARE of the time since and `GRACE` one-token steps (a few rejections in a row are the
        acceptance's own spread, not a wrong model)."""
        ledger, elapsed, grace = self.opened_at
        return ledger + SHARE * (self.elapsed - elapsed) + grace * self.t(1)

    def _run_cost(self, cold: bool = False) -> float | None:
        """What the next drafter run will cost, as a watch is charged it. Warm: measured, else
        what earlier runs measured per one-token pass times this run's t(1), else the process's
        first run's (an upper bound), else None (unknown: the run that times it is not charged
        ahead). `cold`, the process's first run: what this policy or earlier runs measured of
        such a run, else the warm figure (a lower bound)."""
        r = self.remembered
        if cold:
            if self.cold_seconds:
                return self.cold_seconds
            if r is not None and r.cold_share is not None and self._t1_known:
                return r.cold_share * self.t(1)
        warm = self._warm_cost()
        return warm if warm is not None else (self.cold_seconds or None)

    def _warm_cost(self) -> float | None:
        """A warm drafter run's seconds: measured, else remembered per one-token pass times this
        run's t(1), else None."""
        if self.draft_seconds.known:
            return self.draft_seconds.value
        r = self.remembered
        if r is not None and r.draft_share is not None and self._t1_known:
            return r.draft_share * self.t(1)
        return None

    def _affords(self, limit: float, cold: bool = False) -> bool:
        """Whether a watch keeps the ledger within `limit` once charged what its drafter run
        costs (`_run_cost`)."""
        cost = self._run_cost(cold)
        return self.ledger + (cost or 0.0) <= limit

    def _draft_cost(self) -> float:
        """A verifying cycle's seconds beside its pass: the drafter run (warm: measured, else
        remembered, else a prior; a process's first run is no measure of it), and the cycle's own
        work beyond a plain cycle's (measured once it has verified, else a prior)."""
        draft = self._warm_cost()
        if draft is None:
            draft = DRAFT_PRIOR * self.t(1)
        if self.verify_other.known and self.plain_other.known:
            return draft + max(0.0, self.verify_other.value - self.plain_other.value)
        return draft + EXTRA_PRIOR * self.t(1)

    def t(self, n: int) -> float:
        """Predicted seconds of a main-model pass of n tokens: its own mean, drawn up towards the
        fit of all multi-token passes (`_fit`; a length timed once or twice on a loaded machine
        says little: `SHRINK` passes' worth of the fit), never below its own mean."""
        # a one-token mean above the last few one-token passes, or above a longer pass's mean, is
        # stale (plain steps timed early, or under a load since gone, and not timed again while
        # drafting feeds only longer passes): it would make every extra token look free and credit
        # drafts with steps they did not save. The lower figure errs towards plain steps.
        t1 = min([m.value for m in self.passes.values() if m.known] + list(self.recent_t1))
        if n == 1:
            return t1
        jump, slope = self._fit(t1)
        line = t1 + jump + slope * (n - 1)
        m = self.passes.get(n)
        if m is None or not m.known:
            return line
        line = (m.weight * m.value + SHRINK * line) / (m.weight + SHRINK)
        # never below its own mean: blending a measured cost down towards the fit would credit
        # drafts of that length with time they do not save
        return max(line, m.value)

    def _fit(self, t1: float) -> tuple[float, float]:
        """(jump, slope): a pass of n > 1 tokens costs t(1) + jump + slope * (n - 1), fitted to the
        multi-token passes' means (least squares, weighted by their counts). Not one slope through
        t(1): on demo-v41 in RAM 2 tokens cost 1.56 steps, 3 tokens 1.84, each further 0.1-0.3
        (one-token products are row kernels, longer ones others; under load a verification pass
        of 4-9 tokens cost 2 steps whatever its length), so a slope through t(1) fitted to long
        passes under-predicts the short ones a middling drafter uses. With one length timed the
        slope is the prior (what a one-token pass reads, at the read rate, and a share of its
        compute) and the jump what is left; before any, no jump."""
        reads = self.step_bytes.value / self.read_rate.value if self.read_rate.known else 0.0
        prior = reads + COMPUTE_SHARE * max(0.0, t1 - reads)
        pts = [(n - 1, m.value - t1, m.weight) for n, m in self.passes.items() if n > 1 and m.known]
        if not pts:
            return 0.0, prior
        w = sum(q for _, _, q in pts)
        mx, my = sum(x * q for x, _, q in pts) / w, sum(y * q for _, y, q in pts) / w
        sxx = sum(q * (x - mx) ** 2 for x, _, q in pts)
        slope = max(0.0, sum(q * (x - mx) * (y - my) for x, y, q in pts) / sxx) if sxx > 0 else prior
        jump = my - slope * mx
        if jump < 0:  # convex: the line through t(1) that fits best
            jump, slope = 0.0, max(0.0, sum(q * x * y for x, y, q in pts) / sum(q * x * x for x, _, q in pts))
        return jump, slope

    def _alphas(self, k: int, confidence: Sequence[float] | None) -> list[float]:
        a = self.alpha
        if confidence is None or not self.conf_mean.known or self.conf_mean.value <= 0:
            return [a] * k
        return [min(0.99, a * _sigmoid(c) / self.conf_mean.value) for c in confidence[:k]]

    def _best(self, kmax: int, alphas: Sequence[float]) -> tuple[int, float]:
        """(k, tokens per second) of the best draft length in 0..kmax, slot j accepted with alphas[j]."""
        # each length's predicted pass once (t(n) fits every timed length: ~0.5 ms a decision when
        # the loops below called it per term, a step's 1 % on demo-v41)
        t = [0.0, *(self.t(n) for n in range(1, kmax + 2))]  # t[n]: a pass of n tokens
        best, rate = 0, 1.0 / max(t[1], 1e-9)
        draft = self._draft_cost()
        for k in range(1, kmax + 1):
            tokens, reach, refeed = 1.0, 1.0, 0.0
            for j in range(k):  # reach: P(drafts 0..j-1 all accepted)
                # a rejection at j: its j + 1 kept tokens open the next pass (its extra tokens)
                refeed += reach * (1.0 - alphas[j]) * max(0.0, t[j + 2] - t[1])
                reach *= alphas[j]
                tokens += reach
            r = tokens / (draft + t[k + 1] + refeed)
            if r > rate * 1.0001:
                best, rate = k, r
        return best, rate

    def _could_pay(self, alpha: float, gain: float) -> bool:
        """Drafting a block at acceptance alpha beats plain steps by more than `gain`."""
        return self._best(self.block, [alpha] * self.block)[1] * self.t(1) > 1.0 + gain

    def _recall(self) -> None:
        """Once t(1) is known, weigh the remembered acceptance (its counts over earlier runs, each
        side's range `SPREAD` wide). Where drafting would pay even at its low end: an episode
        opens with a watch of one draft (one drafter run checks the memory against this prompt,
        compared at the next pick; drafting follows from the cycle after where it holds). Where only its high end
        could pay, or every `REVISIT`-th run: the first episode's first watch is not charged
        ahead, as a first run's is not. Otherwise watches wait until the ledger affords their
        remembered cost, as later episodes' do: a drafter that accepted nothing in earlier runs
        costs a short reply nothing."""
        self.recalled = True
        r = self.remembered
        if r is None or self.watching or self.drafting:
            return
        n = r.accepted + r.rejected + SPREAD
        low, high = r.accepted / n, (r.accepted + SPREAD) / n
        if r.accepted > 0 and self._could_pay(low, 0.0):
            self.watching, self.watches, self.opened_at = 1, 0, (self.ledger, self.elapsed, GRACE)
            self.checking = True
        elif self._could_pay(high, MIN_GAIN) or r.runs % REVISIT == 0:
            self.free = True

    def most(self, kmax: int) -> int:
        if kmax <= 0 or not self._t1_known:
            return 0
        if not self.recalled:
            self._recall()
        if self.drafting:
            if self.since_t1 >= REMEASURE:  # t(1) not timed for a while: one plain step times it
                return 0
            k = self._best(kmax, self._alphas(kmax, None))[0]
            if k and self.ledger <= self.bound:
                return self._explore(k, kmax)
            if self._affords(self.bound) and self._could_pay(self._range()[1], 0.0):
                # rejections in a row: watch again, cheaply, until the acceptance says which
                self.drafting, self.watching, self.watches = False, self.block, 0
            else:  # drafting cannot pay, or lost more than the model said (the model is wrong here)
                self._close(paid=self.ledger < self.opened_at[0])
            return 0
        if not self.watching:
            self.idle += 1
        return 0

    def watch(self, kmax: int, remaining: int | None = None, cold: bool = False) -> int:
        """Drafts to watch this cycle (most gave 0): the current episode's next watch, or the first
        of a new episode once it is due, affordable, could pay, and `remaining` (tokens the reply
        may still pick after this cycle's; None: unknown) leaves `HORIZON` drafter runs' worth of
        steps to use what it learns (a watch near a reply's end can no longer pay for itself)."""
        if kmax <= 0 or not self._t1_known or self.drafting:  # (drafting: a plain step timing t(1))
            return 0
        if self.watching:
            return min(self.watching, kmax)
        if self.idle < self.wait or not (self.free or self._affords(SHARE * self.elapsed, cold)):
            return 0
        cost = self._run_cost(cold)
        if remaining is not None and cost is not None and remaining * self.t(1) < HORIZON * cost:
            return 0
        if not self._could_pay(CEILING, MIN_GAIN):  # not even a drafter right almost always
            self.idle = 0
            return 0
        self.watching, self.opened_at, self.free = 1, (self.ledger, self.elapsed, GRACE), False
        return 1

    def _explore(self, k: int, kmax: int) -> int:
        """k, or k + 1 while drafting pays and a pass of k + 2 tokens was never timed: a pass's cost
        grows less than linearly in its tokens (products over a few rows share each weight read),
        so the slope measured on shorter passes would keep the drafts short for good. At most
        `FIRST_MOST` while no multi-token pass was timed: the first verification's length would
        rest on a prior alone, and at a streaming budget a pass of 6 tokens read the union of
        their experts (2.1-2.6 steps on demo-v41, 0.63 GB) where the prior said less."""
        if not self._multi_timed:
            return min(k, FIRST_MOST)
        if 0 < k < kmax and not self.passes.get(k + 2, _Mean()).known:
            return k + 1
        return k

    def cut(self, confidence: Sequence[float], kmax: int) -> int:
        return self._explore(self._best(kmax, self._alphas(kmax, confidence))[0], kmax)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x > -60 else 0.0


def policy_for(setting: str | int, block: int) -> FixedDrafts | AutoDrafts:
    """The policy of a `--speculate` setting already checked ("auto" or N >= 1)."""
    return AutoDrafts(block) if setting == "auto" else FixedDrafts(int(setting))
