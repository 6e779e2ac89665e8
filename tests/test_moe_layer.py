"""A layer's routed experts in one pair of driver calls under `fast` numerics, through the real
engine and expert store (a generated checkpoint whose widths the FP4 drivers take).

Checked: a decode layer whose experts are in memory runs `pair_products` and `down_sum` once
each (two driver calls, not two per expert); the store pins a layer's experts together only
within the slots the plan gives, so a tight budget falls back to smaller groups without a pin
beyond the slots; every way (in memory, streamed at a large and at the smallest budget, with
--verify, one expert at a time) gives the same logits bit for bit as each expert's own products.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dsv4stream import kernels, synth
from dsv4stream.engine.session import Engine
from dsv4stream.kernels import cpu, experts_q8
from dsv4stream.model import moe
from dsv4stream.run import planner
from dsv4stream.run.memory import measure
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.store import ExpertStore

pytestmark = pytest.mark.skipif(cpu.variant("fp4") is None, reason="no fast FP4 variant on this CPU")
PROMPT = [3, 17, 101, 5, 250, 7, 9]
STEPS = [11, 40, 2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    # 256 wide: the FP4 drivers' width (q8.supports); 8 experts, top-2
    return synth.make_checkpoint(
        tmp_path_factory.mktemp("m") / "w256", "tiny", seed=4, hidden_size=256, moe_intermediate_size=256
    )


@pytest.fixture
def layers(monkeypatch) -> list:
    """Every `experts_q8.Layer` the MoE makes, in order (its `calls` counts driver calls)."""
    made: list = []
    real = moe.q8_layer
    monkeypatch.setattr(moe, "q8_layer", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    return made


def logits(session) -> np.ndarray:
    """The prompt's prefill logits and three decode steps' logits, stacked."""
    rows = [session.prefill(PROMPT)]
    rows += [session.step(t)[None] for t in STEPS]
    return np.concatenate(rows)


def run(ckpt: Path, budget: int, **kw) -> tuple[np.ndarray, object]:
    with Runtime.open(ckpt, RunOptions(budget=budget, overhead=0, chunk=4, numerics="fast", **kw)) as rt:
        return logits(rt.session()), rt.stats()


def test_a_decode_layer_in_memory_takes_two_driver_calls(ckpt, layers):
    kernels.set_numerics("fast")
    session = Engine.open(ckpt, numerics="fast").session()
    session.prefill(PROMPT)
    layers.clear()
    session.step(STEPS[0])
    n = session.cfg.n_layers
    assert len(layers) == n and [lay.calls for lay in layers] == [2] * n  # was 2 per expert (k = 2: 4)


def test_every_budget_and_grouping_gives_the_per_expert_bits(ckpt, layers, monkeypatch):
    kernels.set_numerics("fast")
    engine = Engine.open(ckpt, numerics="fast")
    in_memory = logits(engine.session())
    assert layers and all(lay.calls == 2 for lay in layers)  # every layer's experts in one group
    n = measure(ckpt, RunOptions(budget=1, overhead=0, chunk=4, numerics="fast"))
    floor = planner.minimum_budget(n)
    big, _ = run(ckpt, 8 * floor)
    np.testing.assert_array_equal(big, in_memory)

    pins: list[tuple[int, int]] = []  # (pinned slots, the store's slots) at each group handed out
    real = ExpertStore.get_groups

    def counted(self, keys):
        for group in real(self, keys):
            pins.append((self._lru.pinned(), self.slots - self._lru.lent))
            yield group

    monkeypatch.setattr(ExpertStore, "get_groups", counted)
    layers.clear()
    tight, stats = run(ckpt, floor, verify=True)
    np.testing.assert_array_equal(tight, in_memory)
    assert stats.verified_reads > 0 and stats.verify_mismatches == 0
    assert pins and all(p <= slots for p, slots in pins)
    assert max(lay.calls for lay in layers) > 2  # some layer's experts did not fit: groups, then the sum

    monkeypatch.setattr(experts_q8, "variant_of", lambda *a: None)  # each expert's own products
    np.testing.assert_array_equal(logits(engine.session()), in_memory)
