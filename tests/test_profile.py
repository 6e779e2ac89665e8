"""DecodeProfile's arithmetic on known waits and a known product time (no model needed)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dsv4stream import kernels
from dsv4stream.kernels import QWeight
from dsv4stream.run.profile import PROFILE_PHASES, DecodeProfile


class Waits:
    def __init__(self) -> None:
        self.wait_seconds = 0.0


def test_phases_split_the_step_wall_time() -> None:
    store, trunk, prof = Waits(), Waits(), DecodeProfile()
    w = QWeight("f32", np.ones((64, 64), np.float32), None, 64, 64, role="experts")
    kernels.matvec(w, np.ones(64, np.float32))  # compiled / loaded outside the timed steps
    for _ in range(2):
        prof.begin(store, trunk)
        t0 = time.perf_counter()
        kernels.matvec(w, np.ones(64, np.float32))
        store.wait_seconds += 0.25  # as if the step had blocked this long on expert reads
        time.sleep(0.02)
        wall = time.perf_counter() - t0
        prof.end(store, trunk)
    p = prof.per_token(2)
    assert tuple(p) == PROFILE_PHASES
    assert p["expert_reads"] == pytest.approx(0.25) and p["trunk_reads"] == 0.0
    assert 0 < p["experts"] < wall and p["trunk"] == 0.0 and p["head"] == 0.0
    # the claimed waits exceed the wall time here, so "other" is clipped at 0, never negative
    assert p["other"] == 0.0
    assert prof.per_token(0) == {}
