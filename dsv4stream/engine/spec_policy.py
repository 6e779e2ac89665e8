"""How many tokens to draft before each verification pass: a fixed N, or `auto` from measured costs.

Owns: `FixedDrafts` (`--speculate N`) and `AutoDrafts` (`--speculate auto`), both asked twice per
cycle by `engine.speculate`: `most(kmax)` before the drafter runs (0: do not even run it) and
`cut(confidence, kmax)` once its per-slot confidence is known; told what happened by
`passed(n, seconds, bytes)` (a main-model pass of n tokens), `drafted(seconds)` and
`verified(k, accepted)`.

`auto`'s model of one cycle that drafts k tokens (k = 0: a plain one-token step):
  cost(k)   = t_draft + t(k + 1) + sum_{a<k} P(first reject at a) * (t(a + 2) - t(1))
  (after a rejection at a, the a + 1 kept tokens are fed again at the start of the next pass)
  tokens(k) = 1 + sum_{j=1..k} prod_{i<j} alpha_i
and it drafts the k in 0..kmax with the most tokens per second, tokens(k) / cost(k).
- t(n): the measured seconds of main-model passes of n tokens (a decaying mean per n); an n not
  yet measured is predicted from t(1) plus a per-extra-token slope: the slope measured by the
  multi-token passes so far, else a prior from what a one-token pass reads: every extra token
  may route to experts no other token of the pass uses, so it costs up to the bytes a one-token
  step reads (its misses) at the measured read rate, plus a share of its compute.
  While drafting pays, a draft one token longer than the best is tried once for each pass length
  not yet measured (predictions from shorter passes overestimate longer ones).
- alpha_i: the acceptance of recent drafts (decaying counts of accepted drafts and first
  rejections: the geometric model's estimate), scaled per slot by the drafter's confidence head
  (sigmoid of its raw output) relative to the confidence of recent drafts.
It never makes a prompt slower than `off` beyond noise: it starts with plain steps (measuring
t(1); its prior acceptance is 0), drafts once `PROBE_FIRST` of them have passed (a one-token
probe), falls back to k = 0 whenever drafting does not pay, and then re-probes with one short
draft only every `probe` cycles, the interval doubling each time the probe did not pay (8 .. 256).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

DECAY = 0.9  # per observation: recent drafts and passes weigh most
PROBE_FIRST, PROBE_MOST = 8, 256
COMPUTE_SHARE = 0.25  # prior: an extra token of a pass costs this share of a step's compute


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

    def passed(self, n: int, seconds: float, read_bytes: int, read_seconds: float) -> None:
        pass

    def drafted(self, seconds: float) -> None:
        pass

    def verified(self, k: int, accepted: int, confidence: Sequence[float]) -> None:
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


@dataclass
class AutoDrafts:
    """`--speculate auto` (see the module docstring)."""

    block: int  # the drafter's most drafts per cycle
    passes: dict[int, _Mean] = field(default_factory=dict)  # n tokens -> seconds
    draft_seconds: _Mean = field(default_factory=_Mean)
    step_bytes: _Mean = field(default_factory=_Mean)  # expert bytes a one-token pass reads
    read_rate: _Mean = field(default_factory=_Mean)  # bytes per second of read time
    slope: _Mean = field(default_factory=_Mean)  # seconds per extra token of a pass, measured
    # decaying counts; the prior: one rejection, alpha = 0, so it drafts nothing before the first
    # probe (PROBE_FIRST plain steps: a short reply runs exactly as off)
    accepted: float = 0.0
    rejected: float = 1.0
    conf_mean: _Mean = field(default_factory=_Mean)
    idle: int = 0  # cycles since the last draft
    probe: int = PROBE_FIRST
    probing: bool = False
    decisions: list[int] = field(default_factory=list)  # k of each cycle (the report's histogram)

    # ---- what it measured -------------------------------------------------------------------
    def passed(self, n: int, seconds: float, read_bytes: int, read_seconds: float) -> None:
        self.passes.setdefault(n, _Mean()).add(seconds)
        if n == 1:
            self.step_bytes.add(read_bytes)
        elif self.passes.get(1, _Mean()).known:
            self.slope.add(max(0.0, (seconds - self.passes[1].value) / (n - 1)))
        if read_bytes and read_seconds > 0:
            self.read_rate.add(read_bytes / read_seconds)

    def drafted(self, seconds: float) -> None:
        self.draft_seconds.add(seconds)

    def verified(self, k: int, accepted: int, confidence: Sequence[float]) -> None:
        self.accepted = self.accepted * DECAY**k + accepted
        self.rejected = self.rejected * DECAY**k + (1 if accepted < k else 0)
        for c in confidence[:k]:
            self.conf_mean.add(_sigmoid(c))
        if self.probing:  # did the probe pay? back off the next probe if not
            self.probe = PROBE_FIRST if self._best(self.block, None)[0] > 0 else min(PROBE_MOST, self.probe * 2)
            self.probing = False

    # ---- decisions ----------------------------------------------------------------------------
    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def t(self, n: int) -> float:
        """Predicted seconds of a main-model pass of n tokens."""
        m = self.passes.get(n)
        if m is not None and m.known:
            return m.value
        t1 = self.passes[1].value
        if self.slope.known:
            slope = self.slope.value
        else:
            reads = self.step_bytes.value / self.read_rate.value if self.read_rate.known else 0.0
            slope = reads + COMPUTE_SHARE * max(0.0, t1 - reads)
        return t1 + slope * (n - 1)

    def _alphas(self, k: int, confidence: Sequence[float] | None) -> list[float]:
        a = self.alpha
        if confidence is None or not self.conf_mean.known or self.conf_mean.value <= 0:
            return [a] * k
        return [min(0.99, a * _sigmoid(c) / self.conf_mean.value) for c in confidence[:k]]

    def _best(self, kmax: int, confidence: Sequence[float] | None) -> tuple[int, float]:
        """(k, tokens per second) of the best draft length in 0..kmax."""
        if not self.passes.get(1, _Mean()).known:
            return 0, 0.0
        best, rate = 0, 1.0 / max(self.t(1), 1e-9)
        alphas = self._alphas(kmax, confidence)
        draft = self.draft_seconds.value if self.draft_seconds.known else self.t(1) * 0.1
        for k in range(1, kmax + 1):
            tokens, reach, refeed = 1.0, 1.0, 0.0
            for j in range(k):  # reach: P(drafts 0..j-1 all accepted)
                # a rejection at j: its j + 1 kept tokens open the next pass (its extra tokens)
                refeed += reach * (1.0 - alphas[j]) * max(0.0, self.t(j + 2) - self.t(1))
                reach *= alphas[j]
                tokens += reach
            r = tokens / (draft + self.t(k + 1) + refeed)
            if r > rate * 1.0001:
                best, rate = k, r
        return best, rate

    def most(self, kmax: int) -> int:
        if kmax <= 0:
            return 0
        k = self._best(kmax, None)[0]
        if k == 0 and self.passes.get(1, _Mean()).known:
            self.idle += 1
            if self.idle >= self.probe:  # re-probe: one short draft refreshes alpha and the costs
                self.idle, self.probing = 0, True
                return 1
        if k:
            self.idle = 0
        return self._explore(k, kmax)

    def _explore(self, k: int, kmax: int) -> int:
        """k, or k + 1 while drafting pays and a pass of k + 2 tokens was never timed: a pass's cost
        grows less than linearly in its tokens (products over a few rows share each weight read),
        so the slope measured on shorter passes would keep the drafts short for good."""
        if 0 < k < kmax and not self.passes.get(k + 2, _Mean()).known:
            return k + 1
        return k

    def cut(self, confidence: Sequence[float], kmax: int) -> int:
        if self.probing:
            return min(1, kmax)
        return self._explore(self._best(kmax, confidence)[0], kmax)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x > -60 else 0.0


def policy_for(setting: str | int, block: int) -> FixedDrafts | AutoDrafts:
    """The policy of a `--speculate` setting already checked ("auto" or N >= 1)."""
    return AutoDrafts(block) if setting == "auto" else FixedDrafts(int(setting))
