"""The decode thread governor (`engine/threads.py`): it keeps the faster count as the load
changes, costs little when the most threads stay fastest, and never changes the ids."""

from __future__ import annotations

from dsv4stream.engine import threads as th
from dsv4stream.engine.threads import ThreadGovernor, candidates


def drive(gov: ThreadGovernor, cost, steps: int, start: int = 0) -> list[int]:
    """Run `steps` steps whose compute takes cost(step, threads) seconds; the counts used."""
    used = []
    for i in range(start, start + steps):
        n = gov.next_threads()
        used.append(n)
        gov.record(n, cost(i, n))
    return used


def test_candidates():
    assert candidates(1) == (1,)
    assert candidates(2) == (2, 1)
    assert candidates(8) == (8, 7, 4, 1)


def test_quiet_keeps_the_most_threads_and_tries_less_and_less_often():
    gov = ThreadGovernor(2)
    used = drive(gov, lambda i, n: {2: 0.070, 1: 0.112}[n], 2000)
    assert gov.current == 2 and gov.switches == 0
    tried = used.count(1)
    # tries at steps 4, 4+32+3, ... with the wait doubling to MAX_PERIOD: 3-step tries, fewer and fewer
    assert 3 * 5 <= tried <= 3 * 12, tried
    assert used[-th.MAX_PERIOD :].count(1) <= 2 * th.PROBE_STEPS


def test_a_busy_core_moves_it_to_one_thread_and_back_when_it_ends():
    gov = ThreadGovernor(2)

    def cost(i, n):
        busy = 100 <= i < 700  # another program takes a core for steps 100..699
        return {2: 0.393, 1: 0.118}[n] if busy else {2: 0.070, 1: 0.112}[n]

    used = drive(gov, cost, 1300)
    # the slowdown is seen within RECENT steps and a try of 1 thread follows at once
    settle = th.RECENT + th.PROBE_STEPS
    assert used[100 + settle : 700].count(1) >= 0.97 * (600 - settle)
    # back at 2 threads within one longest wait and a try of the load ending
    back = 700 + th.MAX_PERIOD + th.PROBE_STEPS
    assert used[back:].count(2) >= 0.97 * (1300 - back)
    assert gov.switches >= 2
    assert gov.summary() == {"2": used.count(2), "1": used.count(1)}


def test_eight_cores_one_busy_settles_on_seven():
    gov = ThreadGovernor(8)
    used = drive(gov, lambda i, n: {8: 0.300, 7: 0.040, 4: 0.060, 1: 0.150}[n], 400)
    assert gov.current == 7
    assert used[-100:].count(7) >= 90


def test_a_close_race_does_not_switch():
    gov = ThreadGovernor(2)
    drive(gov, lambda i, n: {2: 0.100, 1: 0.095}[n], 500)  # within MARGIN: not worth a switch
    assert gov.current == 2 and gov.switches == 0
