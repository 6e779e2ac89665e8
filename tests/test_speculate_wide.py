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
