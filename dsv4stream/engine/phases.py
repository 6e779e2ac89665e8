"""What a session's generation spent its time on, recorded by the session where it happens.

Owns: `PrefillStep` (where a prefill stands after each layer of each segment), `Turn` (one
`Session.generate` call: the tokens it prefilled and how long that took, the time to its
first token, its decode steps timed by phase, why it ended), `PhaseLog` (every turn of an
engine's sessions, summed into `Phases` for a run's figures) and `Counters`, the cumulative
counters of the providers that a `Meter` reads without waiting for anything (the figures a
live display shows, and what a decode step's read waits and bytes are differences of).

A decode step's time is split by phase from counters taken around its forward pass: the
kernels' product time by weight role (`kernels.kernel_seconds()`, two perf_counter calls
per product) and the meter's read waits; the rest of the step's wall time is "other". The
sampler is timed around each pick but the first (which ends the prefill). Nothing here starts
timers inside the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import kernels
from ..errors import InternalError
from .spec_stats import SpecCounts

PROFILE_PHASES = ("experts", "trunk", "head", "expert_reads", "trunk_reads", "sampler", "other")
PROFILE_LABELS = {
    "experts": "experts compute",
    "trunk": "trunk compute",
    "head": "head",
    "expert_reads": "waiting on expert reads",
    "trunk_reads": "waiting on trunk reads",
    "sampler": "sampler",
    "other": "other",
}
_ROLES = ("experts", "trunk", "head")  # the kernels' weight roles the profile splits out


@dataclass(frozen=True)
class Counters:
    """Cumulative counters of a run's providers since they opened, read without waiting for a
    read in flight (a streamed layer still loading counts once it lands). Bytes as read from
    disk; wait = time the forward pass blocked on reads."""

    expert_requests: int = 0
    expert_hits: int = 0
    expert_bytes_read: int = 0
    expert_read_seconds: float = 0.0  # wall time with an expert read in flight
    expert_wait_seconds: float = 0.0
    trunk_bytes_read: int = 0  # streamed trunk layers, after opening
    trunk_wait_seconds: float = 0.0
    engram_bytes_read: int = 0
    engram_wait_seconds: float = 0.0

    @property
    def expert_hit_rate(self) -> float:
        return self.expert_hits / self.expert_requests if self.expert_requests else 0.0

    @property
    def read_gbps(self) -> float:
        return self.expert_bytes_read / self.expert_read_seconds / 1e9 if self.expert_read_seconds else 0.0


# the providers' counters now (an Engine on in-memory weights reads nothing: all zero)
Meter = Callable[[], Counters]


def no_reads() -> Counters:
    return Counters()


@dataclass(frozen=True)
class PrefillStep:
    """Where a prefill stands after one layer of one segment (counts from 1 where 'of')."""

    layer: int  # layers of this segment done, 1..layers
    layers: int
    segment: int  # 1..segments
    segments: int
    done: int  # tokens of the earlier segments (fully prefilled)
    segment_tokens: int
    total: int  # tokens of this prefill call

    @property
    def tokens(self) -> float:
        """Progress in tokens, counting a segment's layers pro rata."""
        return self.done + self.segment_tokens * self.layer / self.layers

    def where(self) -> str:
        return f"layer {self.layer}/{self.layers}, segment {self.segment}/{self.segments}"


@dataclass
class Turn:
    """One `Session.generate` call as the session timed it (seconds, perf_counter)."""

    # tokens its prefill fed (those of whole segments when it stopped), once it ended; None while
    # it runs, and for a turn continued from given logits (nothing prefilled, no time to first token)
    prompt_tokens: int | None = None
    prefill_seconds: float = 0.0  # the prefill, to the first logits
    first_token_seconds: float | None = None  # to the first token picked (None: continued, or none picked)
    prefill_stopped: str = ""  # where a prefill that raised stopped ("" when none did)
    tokens: list[int] = field(default_factory=list)  # every token yielded
    decode_steps: int = 0
    decode_seconds: float = 0.0  # the steps' forward passes (the sampler and the caller excluded)
    profile: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PROFILE_PHASES, 0.0))  # summed over steps
    decode_expert_bytes: int = 0  # read from disk from the end of the prefill to the end of the turn
    decode_engram_bytes: int = 0
    seconds: float = 0.0  # wall time of the whole call, the caller's handling of each token included
    stop_reason: str = ""  # engine.STOP_REASONS, once the call ended
    in_think: bool = False  # set by a caller that knows the text: the turn ended inside <think>
    speculation: SpecCounts | None = None  # drafts and verifications (`engine.speculate`), None without

    def close(self, stop_reason: str, t0: float, meter: Meter, mark) -> None:
        """The call ended: why, its wall time since `t0` (perf_counter), and what the decode
        read from disk since `mark` (the meter at the end of the prefill; None: no decode)."""
        self.stop_reason = stop_reason
        self.seconds = time.perf_counter() - t0
        if mark is not None:
            now = meter()
            self.decode_expert_bytes = now.expert_bytes_read - mark.expert_bytes_read
            self.decode_engram_bytes = now.engram_bytes_read - mark.engram_bytes_read

    def add_step(self, wall: float, spent: dict[str, float]) -> None:
        """One decode step's forward pass (`StepClock.end`)."""
        self.decode_steps += 1
        self.decode_seconds += wall
        for k, v in spent.items():
            self.profile[k] += v


class StepClock:
    """Times one step at a time: `begin()` before its forward pass, `end()` after it gives its
    wall time and its seconds by phase (product time by weight role, read waits, the rest)."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self._mark: tuple[float, dict[str, float], Counters] | None = None

    def begin(self) -> None:
        self._mark = (time.perf_counter(), kernels.kernel_seconds(), self.meter())

    def end(self) -> tuple[float, dict[str, float]]:
        if self._mark is None:
            raise InternalError("StepClock.end() without begin()")
        t0, k0, c0 = self._mark
        self._mark = None
        wall = time.perf_counter() - t0
        k1, c1 = kernels.kernel_seconds(), self.meter()
        spent = {role: k1.get(role, 0.0) - k0.get(role, 0.0) for role in _ROLES}
        spent["expert_reads"] = c1.expert_wait_seconds - c0.expert_wait_seconds
        spent["trunk_reads"] = c1.trunk_wait_seconds - c0.trunk_wait_seconds
        spent["other"] = max(0.0, wall - sum(spent.values()))  # never negative: waits can overlap products
        return wall, spent


@dataclass(frozen=True)
class Phases:
    """The turns of a run summed: prefill and decode, per turn where a chat has several."""

    generated_ids: list[int]
    prompt_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float  # decode steps only: prefill and sampler excluded
    turn_prompt_tokens: list[int]  # per prefilled turn (a chat turn)
    first_token_seconds: list[float]  # per prefilled turn that picked a token
    prefill_stopped: str  # the last stopped prefill's place ("" when none stopped)
    decode_profile: dict[str, float]  # seconds per decode step by PROFILE_PHASES ({} without a step)
    stop_reasons: list[str]
    stopped_in_think: list[bool]
    decode_expert_bytes: int
    decode_engram_bytes: int
    speculation: SpecCounts | None = None  # summed over the turns that drafted (`engine.speculate`)

    @property
    def stop_reason(self) -> str:
        return self.stop_reasons[-1] if self.stop_reasons else ""

    @property
    def decode_seconds_per_token(self) -> float:
        return self.decode_seconds / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_expert_bytes_per_token(self) -> float:
        return self.decode_expert_bytes / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def decode_engram_bytes_per_token(self) -> float:
        return self.decode_engram_bytes / self.decode_tokens if self.decode_tokens else 0.0


class PhaseLog:
    """Every turn of an engine's sessions, in the order they started (appended by `Session.generate`)."""

    def __init__(self) -> None:
        self.turns: list[Turn] = []

    def totals(self) -> Phases:
        turns = self.turns
        prefilled = [t for t in turns if t.prompt_tokens is not None]
        ended = [t for t in turns if t.stop_reason]
        steps = sum(t.decode_steps for t in turns)
        profile = {k: sum(t.profile[k] for t in turns) / steps for k in PROFILE_PHASES} if steps else {}
        return Phases(
            generated_ids=[tok for t in turns for tok in t.tokens],
            prompt_tokens=sum(t.prompt_tokens or 0 for t in prefilled),
            prefill_seconds=sum(t.prefill_seconds for t in prefilled),
            decode_tokens=steps,
            decode_seconds=sum(t.decode_seconds for t in turns),
            turn_prompt_tokens=[t.prompt_tokens or 0 for t in prefilled],
            first_token_seconds=[t.first_token_seconds for t in prefilled if t.first_token_seconds is not None],
            prefill_stopped=next((t.prefill_stopped for t in reversed(turns) if t.prefill_stopped), ""),
            decode_profile=profile,
            stop_reasons=[t.stop_reason for t in ended],
            stopped_in_think=[t.in_think for t in turns],
            decode_expert_bytes=sum(t.decode_expert_bytes for t in turns),
            decode_engram_bytes=sum(t.decode_engram_bytes for t in turns),
            speculation=SpecCounts.total([t.speculation for t in turns if t.speculation is not None]),
        )
