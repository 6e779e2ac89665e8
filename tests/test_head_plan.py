"""The head's share of a plan (`run.planner_head`): one rule for `Runtime.open`, `dsv4 inspect`
(measured and --config-only), doctor and the plan printout; the int8 copy where fast reads it,
the BF16 head then left in its file, mapped: its bytes become expert slots, the logits' bits
do not change, no page of it is touched by a step or by the drafter (which proposes with the
copy), the NaN diagnosis reads through the map."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dsv4stream import kernels, synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.model.scan import nonfinite_fields
from dsv4stream.run import planner, planner_head
from dsv4stream.run.memory import measure, needs_of
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.trunkpack.format import MANIFEST
from dsv4stream.trunkpack.packdir import default_out_dir
from dsv4stream.trunkpack.reader import TrunkFile
from dsv4stream.trunkpack.writer import pack_trunk
from tests.cli_runs import dsv4

pytestmark = pytest.mark.skipif(
    kernels.backend_name() != "fast" or not kernels.head.copy_runs(), reason="the int8 head copy's kernels"
)
HEAD = "head.weight"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny V4 checkpoint (no drafter) packed into its default trunk directory, as `dsv4 run` finds it."""
    ck = synth.make_checkpoint(tmp_path_factory.mktemp("hp") / "ckpt", "tiny", seed=0)
    pack_trunk(ck, default_out_dir(ck), progress=False)
    return ck


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> Path:
    """The same with V4-Flash-0731's DSpark drafter, which proposes with the BF16 head."""
    ck = synth.make_checkpoint(tmp_path_factory.mktemp("hp") / "d0731", "tiny-0731", seed=0)
    pack_trunk(ck, default_out_dir(ck), progress=False)
    return ck


def _opts(budget: int, numerics: str, **kw) -> RunOptions:
    return RunOptions(budget=budget, io="buffered", numerics=numerics, **kw)


def _copy_size(ck: Path) -> int:
    return json.loads((default_out_dir(ck) / MANIFEST).read_text())["head_q8"]["file_bytes"]


def _tight(ck: Path, **kw) -> int:
    """One byte above the smallest budget exact runs at: every byte of it counts."""
    return planner.minimum_budget(measure(ck, RunOptions(budget=1, numerics="exact", **kw))) + 1


# ---------------------------------------------------------------- the rule -------------------


def test_the_copy_is_offered_only_where_fast_reads_it(ckpt):
    size = _copy_size(ckpt)
    fast = measure(ckpt, RunOptions(budget=1, numerics="fast"))
    assert fast.head_q8_bytes == size
    assert fast.head_matrix_bytes >= 512 * 64 * 2  # the BF16 matrix (vocab x hidden), its window included
    for mode in ("exact", "official", None):  # None: V4's default for an engine, exact
        assert measure(ckpt, RunOptions(budget=1, numerics=mode)).head_q8_bytes == 0
    assert measure(ckpt, RunOptions(budget=1, numerics="fast", trunk="")).head_q8_bytes == 0  # no pack, no copy


def test_without_a_drafter_the_bf16_head_stays_on_disk_and_its_bytes_become_slots(ckpt):
    fast, exact = measure(ckpt, RunOptions(budget=1, numerics="fast")), measure(ckpt, RunOptions(budget=1))
    tight = _tight(ckpt)
    pf, pe = planner.plan(fast, tight), planner.plan(exact, tight)
    assert pf.needs.head_mode == planner_head.INT8 and pe.needs.head_mode == planner_head.BF16
    assert pf.needs == fast and pe.needs == exact  # measured needs hold the plan's head already
    saved = fast.head_matrix_bytes - fast.head_q8_bytes
    assert pf.needs.fixed_bytes == pe.needs.fixed_bytes - saved
    # the head's saving is expert slots (or a pinned layer, which the planner takes first)
    assert (pf.expert_slots, pf.pinned_layers) > (pe.expert_slots, pe.pinned_layers)
    assert planner.minimum_budget(fast) == planner.minimum_budget(exact) - saved
    assert any("BF16 head" in ln and "on disk" in ln for ln in pf.lines())


def test_with_a_drafter_the_bf16_head_stays_on_disk_too(drafter):
    """The DSpark drafter proposes with the copy too (`kernels.head.head_logits`), so a run that
    drafts leaves the BF16 head in its file as one that does not."""
    tight = _tight(drafter)
    for spec in ("auto", "off"):
        fast = measure(drafter, RunOptions(budget=1, numerics="fast", speculate=spec))
        assert fast.head_q8_bytes == _copy_size(drafter)
        ex = planner.plan(measure(drafter, RunOptions(budget=1, numerics="exact", speculate=spec)), tight)
        p = planner.plan(fast, tight)
        assert p.needs.head_mode == planner_head.INT8
        assert (p.expert_slots, p.pinned_layers) >= (ex.expert_slots, ex.pinned_layers)
        assert p.needs.fixed_bytes == ex.needs.fixed_bytes - fast.head_matrix_bytes + fast.head_q8_bytes


@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("which", ["ckpt", "drafter"])
def test_inspect_plans_what_the_run_holds(which, numerics, request):
    """At a tight and a roomy budget: `Runtime.open`'s plan is the one `needs_of` (inspect,
    doctor, bench) gives, field for field, and `dsv4 inspect --budget` prints its lines; the
    --config-only estimate takes the same head decision with the same copy and matrix bytes."""
    ck = request.getfixturevalue(which)
    for budget in (_tight(ck), 10**9):
        with Runtime.open(ck, _opts(budget, numerics)) as rt:
            run_plan = rt.plan
            assert (rt.engine.stack.head_weights().q8 is not None) == (run_plan.needs.head_mode != planner_head.BF16)
        assert planner.plan(needs_of(ck, numerics=numerics)[0], budget) == run_plan
        r = dsv4("inspect", str(ck), "--budget", repr(budget / 1e9), "--numerics", numerics)
        assert r.returncode == 0, r.stderr
        for line in run_plan.lines():
            assert line in r.stdout.splitlines(), (line, r.stdout)
        # --config-only: the release dtypes' estimate (aligned windows aside), at its own tight budget
        est_needs, _ = needs_of(ck / "config.json", numerics=numerics)
        est_budget = budget if budget == 10**9 else planner.minimum_budget(replace(est_needs, head_q8_bytes=0)) + 1
        est = planner.plan(est_needs, est_budget)
        assert est.needs.head_mode == run_plan.needs.head_mode
        assert (est.needs.head_q8_bytes, est.needs.head_matrix_bytes) == (
            run_plan.needs.head_q8_bytes,
            run_plan.needs.head_matrix_bytes,
        )


# ---------------------------------------------------------------- the run --------------------


def _mapped_rss_kb(a: np.ndarray) -> int:
    """Resident kB of the mapping that holds array `a` (/proc/self/smaps)."""
    addr = a.__array_interface__["data"][0]
    text = Path("/proc/self/smaps").read_text()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(x, 16) for x in block.split(" ", 1)[0].split("-"))
        if lo <= addr < hi:
            return int(re.search(r"^Rss:\s+(\d+) kB", block, re.MULTILINE).group(1))
    raise AssertionError("no mapping holds the array")


def test_the_mapped_head_is_never_paged_in_not_even_by_the_drafter(drafter):
    """A fast run that drafts (a fixed 2 drafts a cycle) touches no page of the mapped BF16 head:
    the drafter proposes with the copy; its ids are those of the run without drafts."""
    ids = [1, 2, 3, 4, 5, 6, 7]
    with Runtime.open(drafter, _opts(10**9, "fast")) as rt:
        top = rt.engine.stack.head_weights()
        assert rt.plan.needs.head_mode == planner_head.INT8 and top.q8 is not None
        assert not top.head.data.flags.writeable  # the map is read-only
        drafted = list(rt.generate(rt.session(), ids, 8, speculate=2))
        assert rt.engine.phases.turns[-1].speculation.drafted > 0
        plain = list(rt.generate(rt.session(), ids, 8, speculate="off"))
        assert _mapped_rss_kb(top.head.data) == 0
    assert drafted == plain


def test_fasts_bits_do_not_depend_on_where_the_bf16_head_is(ckpt):
    """The same logits with the BF16 head mapped and with it read into memory (as a run
    without the copy holds it): fast with the copy never multiplies by it."""
    ids = np.array([1, 2, 3, 4, 5, 6, 7])
    with Runtime.open(ckpt, _opts(10**9, "fast")) as rt:
        top = rt.engine.stack.head_weights()
        mapped = rt.session().prefill(ids)
        resident = replace(top, head=replace(top.head, data=np.array(top.head.data)))
        assert resident.head.data.flags.writeable and resident.q8 is top.q8
        rt.trunk._head = resident
        np.testing.assert_array_equal(rt.session().prefill(ids), mapped)


def test_the_nan_diagnosis_reads_through_the_map(ckpt, tmp_path):
    """A NaN in the BF16 head's bytes in the pack (which fast never multiplies by) is found by the
    diagnosis `Session` runs after non-finite logits: it reads the head through the map."""
    ck = tmp_path / "ck"
    shutil.copytree(ckpt, ck)
    cat = Catalog.open(ck)
    tf = TrunkFile.open(default_out_dir(ck), cat)
    # in the shard too: opening a pack compares slices of it with the shards
    for path, off in ((tf.path, tf.entry(HEAD).offset), (cat.entry(HEAD).path, cat.entry(HEAD).offset)):
        with open(path, "r+b") as f:
            f.seek(off + 2 * 64 * 7)
            f.write(np.array([0x7FC0], np.uint16).tobytes())  # BF16 NaN in row 7
    tf.close()
    with Runtime.open(ck, _opts(10**9, "fast")) as rt:
        assert rt.plan.needs.head_mode == planner_head.INT8
        assert nonfinite_fields(rt.engine.stack.head_weights()) == ["head"]
