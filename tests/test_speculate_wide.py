"""Speculation on a V4.1 checkpoint wide enough for the fast kernels (hidden 256, head_dim 128,
a window of 8 that wraps early), run the way a server runs it: many generations on one Runtime,
speculation on and off per request.

What it guards: greedy ids with `--speculate N` / `auto` equal `off` because each row of a
verification pass carries the bits of a one-token step at its position. Before the window was
read in position order (`model.cache.WindowCache.with_new`), a query of a k-token pass past the
window met its keys in another order than a step does: its row differed in the last bits, and
official numerics' activation grids rounded that into other greedy ids (seed 4 below: from the
21st token). Also: a run of rejected drafts no longer lengthens every pass (the carry is bounded).
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime

WIDE = {
    "hidden_size": 256,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "moe_intermediate_size": 256,
    "sliding_window": 8,
    "index_head_dim": 64,
    "index_topk": 6,
    "candidate_topk_blocks": 4,
    "candidate_block_size": 2,
}
PROMPT = list(range(3, 19))
GEN = 28


@pytest.fixture(scope="module")
def wide_v41(tmp_path_factory):
    from dsv4stream.synth import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("v41") / "wide-v41", "tiny-v41", seed=4, **WIDE)


def _runtime(path, numerics: str) -> Runtime:
    return Runtime.open(path, RunOptions(budget=2 * 10**9, threads=1, trunk="", numerics=numerics))


@pytest.mark.parametrize("numerics", ["exact", "official", "fast"])
def test_pass_rows_equal_one_token_steps_past_the_window(wide_v41, numerics):
    """Rows of 2- to 6-token passes that start past the window (ring wrapped) equal, bit for bit,
    the rows of one-token steps at the same positions."""
    with _runtime(wide_v41, numerics) as rt:
        ids = list(rt.generate(rt.session(), PROMPT, 24, speculate="off"))
        a = rt.session()
        a.prefill(np.array(PROMPT))
        steps = np.concatenate([a.prefill(np.array([t])) for t in ids])
        for start, n in ((0, 6), (3, 4), (9, 5), (17, 2)):
            b = rt.session()
            b.prefill(np.array(PROMPT + ids[:start]))
            rows = b.prefill(np.array(ids[start : start + n]))
            np.testing.assert_array_equal(rows, steps[start : start + n], err_msg=f"{numerics} pass at {start}")


@pytest.mark.parametrize("numerics", ["official", "fast"])
def test_server_sequence_greedy_ids_equal_off(wide_v41, numerics):
    """One Runtime, one request after another as a server runs them (off, 3, auto, off again,
    then 1..5): every setting's greedy ids equal the first off's, and a pass never holds more than
    two blocks (before the carry was bounded, fixed N with rejected drafts grew it every cycle)."""
    with _runtime(wide_v41, numerics) as rt:
        block = rt.speculator.block
        off = list(rt.generate(rt.session(), PROMPT, GEN, speculate="off"))
        for setting in ("3", "auto", "off", "1", "2", "4", "5"):
            s = rt.session()
            lengths: list[int] = []
            feed = s.prefill

            def counted(ids, *a, feed=feed, lengths=lengths, **kw):
                lengths.append(np.asarray(ids).size)
                return feed(ids, *a, **kw)

            s.prefill = counted
            got = list(rt.generate(s, PROMPT, GEN, speculate=setting))
            assert got == off, f"{numerics} --speculate {setting}: ids differ from off at {_first_diff(got, off)}"
            assert max(lengths[1:], default=0) <= 2 * (block + 1), f"--speculate {setting}: passes {lengths}"


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.parametrize("numerics", ["exact", "official", "fast"])
def test_rows_folded_into_a_step_keep_its_bits(wide_v41, numerics):
    """`Session.step_with_rows`: the token's logits are the bits `step` gives, and the extra rows'
    logits are the bits of a head call of their own (what a watch's drafts are picked from)."""
    from dsv4stream.kernels.head import head_logits

    rng = np.random.default_rng(5)
    with _runtime(wide_v41, numerics) as rt:
        top = rt.engine.stack.head_weights()
        for n in (1, 2, 5):
            extra = rng.standard_normal((n, rt.engine.cfg.hidden_size)).astype(np.float32)
            a, b = rt.session(), rt.session()
            a.prefill(np.array(PROMPT))
            b.prefill(np.array(PROMPT))
            assert b.folds_rows()
            want = a.step(7)
            own, theirs = b.step_with_rows(7, extra)
            np.testing.assert_array_equal(own, want, err_msg=f"{numerics}: the token's row with {n} rows beside it")
            np.testing.assert_array_equal(theirs, head_logits(top.head, top.q8, extra), err_msg=f"{numerics} n={n}")
            assert b.pos == a.pos


class _Watching:
    """A policy that never drafts and watches w drafts every third cycle (an `AutoDrafts`
    learning), recording what each watch saw."""

    def __init__(self, w: int) -> None:
        self.w, self.cycle, self.seen, self.runs = w, 0, [], []

    def most(self, kmax):
        self.cycle += 1
        return 0

    def cut(self, confidence, kmax):
        return kmax

    def watch(self, kmax, remaining=None, cold=False):
        return min(self.w, kmax) if self.cycle % 3 == 0 else 0

    def watched(self, k, accepted, confidence):
        self.seen.append((k, accepted, [round(c, 6) for c in confidence]))

    def drafted(self, seconds, cold=False, run=None):
        self.runs.append((seconds, run))

    def settled(self, seconds, tokens): ...

    def overhead(self, verified, seconds): ...

    def passed(self, n, seconds, read_bytes, read_seconds): ...

    def verified(self, k, accepted, confidence): ...


@pytest.mark.parametrize("numerics", ["official", "fast"])
def test_folded_watches_see_what_their_own_head_call_sees(wide_v41, numerics, monkeypatch):
    """A watch's head rows go into the next one-token pass's head call: the ids are off's, each
    watch compares the same drafts with the same picks as a watch that runs its own head call
    (the checkpoint's drafter, its random weights), and the policy learns a run's cost with a
    head call of its own (`run`) while it is charged what the watch added."""
    from dsv4stream.engine.session import Session
    from dsv4stream.engine.speculate import speculative_generate
    from dsv4stream.text.sampler import greedy

    with _runtime(wide_v41, numerics) as rt:
        off = list(rt.generate(rt.session(), PROMPT, GEN, speculate="off"))
        got = {}
        step_rows = Session.step_with_rows
        for folds in (True, False):
            monkeypatch.setattr(Session, "folds_rows", lambda self, folds=folds: folds)
            calls: list[int] = []

            def counted(s, t, r, calls=calls):
                calls.append(len(r))
                return step_rows(s, t, r)

            monkeypatch.setattr(Session, "step_with_rows", counted)
            s = rt.session()
            policy = _Watching(2)
            ids = list(speculative_generate(s, PROMPT, GEN, greedy, rt.speculator.drafter(s), policy))
            assert ids == off, f"folds={folds}: ids differ from off at {_first_diff(ids, off)}"
            spec = s.turn.speculation
            assert spec.watches == len(policy.runs) >= 5 and spec.drafted == 0
            assert calls == ([2] * spec.watches if folds else [])
            assert all((run is not None) == folds for _, run in policy.runs)
            assert all(seconds > 0 and (run is None or run > 0) for seconds, run in policy.runs), policy.runs
            got[folds] = (policy.seen, spec.watch_drafted, spec.watch_accepted)
        assert got[True] == got[False]
