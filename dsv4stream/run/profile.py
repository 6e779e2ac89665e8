"""Where decode time goes: the per-token profile `--stats` prints and `--stats-json` writes.

Owns: the phases (`PROFILE_PHASES`) and `DecodeProfile`, which takes differences of cheap
cumulative counters around each decode step: `kernels.kernel_seconds()` (time inside the
matrix products, by weight role) and the expert store's and trunk ring's read-wait seconds.
The rest of the step's wall time is "other"; the runtime adds the sampler's time. Nothing
here starts timers inside the model: it costs two perf_counter calls per product.
"""

from __future__ import annotations

import time
from typing import Protocol

from .. import kernels
from ..errors import InternalError


class _Waits(Protocol):
    @property
    def wait_seconds(self) -> float: ...


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


class DecodeProfile:
    """Where decode steps spend their time: coarse timers around each step (perf_counter), the
    kernels' per-role product time, and the providers' read-wait counters, as differences."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PROFILE_PHASES, 0.0)
        self._mark: tuple[float, dict[str, float], float, float] | None = None

    def begin(self, store: _Waits, trunk: _Waits) -> None:
        self._mark = (time.perf_counter(), kernels.kernel_seconds(), store.wait_seconds, trunk.wait_seconds)

    def end(self, store: _Waits, trunk: _Waits) -> None:
        if self._mark is None:
            raise InternalError("DecodeProfile.end() without begin()")
        t0, k0, e0, w0 = self._mark
        wall = time.perf_counter() - t0
        k1 = kernels.kernel_seconds()
        spent = {role: k1.get(role, 0.0) - k0.get(role, 0.0) for role in ("experts", "trunk", "head")}
        spent["expert_reads"] = store.wait_seconds - e0
        spent["trunk_reads"] = trunk.wait_seconds - w0
        for k, v in spent.items():
            self.seconds[k] += v
        self.seconds["other"] += max(0.0, wall - sum(spent.values()))

    def per_token(self, steps: int) -> dict[str, float]:
        return {k: v / steps for k, v in self.seconds.items()} if steps else {}
