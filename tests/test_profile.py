"""The session times its own phases: a step's split by phase on known waits and a known product
time, each generate call's record (prefill, first token, decode steps, stop), and their sums."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from dsv4stream import kernels, synth
from dsv4stream.engine.phases import PROFILE_PHASES, Counters, PhaseLog, StepClock, Turn
from dsv4stream.engine.session import Engine


class Meter:
    """Counters a test moves by hand (as if the forward pass had waited on reads)."""

    def __init__(self) -> None:
        self.now = Counters()

    def __call__(self) -> Counters:
        return self.now


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return synth.make_checkpoint(tmp_path_factory.mktemp("p") / "tiny", preset="tiny", seed=3)


def test_a_steps_phases_split_its_wall_time() -> None:
    meter, turn = Meter(), Turn()
    clock = StepClock(meter)
    w = kernels.QWeight("f32", np.ones((64, 64), np.float32), None, 64, 64, role="experts")
    kernels.matvec(w, np.ones(64, np.float32))  # compiled / loaded outside the timed steps
    walls = []
    for _ in range(2):
        clock.begin()
        t0 = time.perf_counter()
        kernels.matvec(w, np.ones(64, np.float32))
        meter.now = replace(meter.now, expert_wait_seconds=meter.now.expert_wait_seconds + 0.25)
        time.sleep(0.02)
        walls.append(time.perf_counter() - t0)
        turn.add_step(*clock.end())
    p = turn.profile
    assert tuple(p) == PROFILE_PHASES and turn.decode_steps == 2
    assert p["expert_reads"] == pytest.approx(0.5) and p["trunk_reads"] == 0.0
    assert 0 < p["experts"] < sum(walls) and p["trunk"] == 0.0 and p["head"] == 0.0
    assert sum(walls) <= turn.decode_seconds < sum(walls) + 0.01
    # the claimed waits exceed the wall time here, so "other" is clipped at 0, never negative
    assert p["other"] == 0.0 and p["sampler"] == 0.0


def test_each_generate_call_records_its_own_phases(ckpt) -> None:
    eng = Engine.open(ckpt)
    s = eng.session(chunk_size=4, segment=4)

    def slow_pick(logits: np.ndarray) -> int:
        time.sleep(0.01)  # a sampler that takes a known time
        return int(np.argmax(logits))

    t0 = time.perf_counter()
    got = list(s.generate([1, 2, 3, 4, 5, 6], 4, slow_pick))
    wall = time.perf_counter() - t0
    turn = s.turn
    assert turn is eng.phases.turns[-1] and turn.tokens == got and len(got) == 4
    assert turn.prompt_tokens == 6 and turn.stop_reason == "gen_limit" == s.stop_reason
    assert 0 < turn.prefill_seconds < turn.first_token_seconds < wall
    assert turn.first_token_seconds - turn.prefill_seconds >= 0.01  # the first pick ends the prefill
    assert turn.decode_steps == 3 and turn.decode_seconds > 0
    assert 0.03 <= turn.profile["sampler"] < 0.03 + 0.02  # the three later picks, not the first
    assert turn.decode_expert_bytes == 0  # in-memory experts: the default meter reads nothing
    assert turn.prefill_seconds + turn.decode_seconds + turn.profile["sampler"] <= turn.seconds <= wall
    # the decode step's phases add up to its wall time (the sampler is outside the step)
    step = sum(v for k, v in turn.profile.items() if k != "sampler")
    assert step == pytest.approx(turn.decode_seconds, rel=1e-6)

    # a reply continued from the prompt's logits prefills nothing and has no first-token time
    logits = eng.session().prefill([1, 2, 3, 4, 5, 6], last_only=True)
    again = eng.session()
    again.restore(s.snapshot())
    cont = list(again.generate([], 2, logits=logits))
    assert again.turn.prompt_tokens is None and again.turn.first_token_seconds is None
    assert again.turn.decode_steps == 1 and len(cont) == 2

    t = eng.phases.totals()
    assert t.turn_prompt_tokens == [6] and t.prompt_tokens == 6 and len(t.first_token_seconds) == 1
    assert t.decode_tokens == 4 and t.generated_ids == got + cont and t.stop_reasons == ["gen_limit"] * 2
    assert t.decode_seconds_per_token == pytest.approx((turn.decode_seconds + again.turn.decode_seconds) / 4)
    assert tuple(t.decode_profile) == PROFILE_PHASES and t.stopped_in_think == [False, False]


def test_a_stopped_prefill_says_where_and_counts_what_it_fed(ckpt) -> None:
    eng = Engine.open(ckpt)
    s = eng.session(chunk_size=4, segment=4)
    n = eng.cfg.n_layers

    def stop_in_segment_two(step) -> None:
        if step.segment == 2 and step.layer == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        list(s.generate(list(range(1, 11)), 3, on_layer=stop_in_segment_two))
    turn = s.turn
    assert turn.prompt_tokens == 4 and turn.tokens == [] and turn.stop_reason == "interrupted"
    assert turn.prefill_stopped == f"4 of 10 tokens fed; stopped after layer 1/{n}, segment 2/3"
    assert turn.first_token_seconds is None and turn.prefill_seconds > 0
    t = eng.phases.totals()
    assert t.prefill_stopped == turn.prefill_stopped and t.turn_prompt_tokens == [4] and t.first_token_seconds == []


def test_totals_of_no_turn_are_empty() -> None:
    t = PhaseLog().totals()
    assert t.decode_profile == {} and t.decode_seconds_per_token == 0.0 and t.stop_reason == ""
    assert t.prefill_tokens_per_second == 0.0 and t.decode_expert_bytes_per_token == 0.0
