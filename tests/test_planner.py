"""The budget planner on the released V4-Flash config and on hand-built sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4stream.checkpoint.config import ModelConfig
from dsv4stream.errors import BudgetError
from dsv4stream.run.planner import (
    GB,
    SEGMENT_CAP,
    MemoryNeeds,
    budget_for,
    minimum_budget,
    needs_from_config,
    plan,
    state_bytes_for,
)

FLASH = ModelConfig.from_json(Path(__file__).resolve().parents[1] / "dsv4stream" / "v4_flash_config.json")


def test_flash_budget_3_has_a_working_plan_under_3_gb():
    needs = needs_from_config(FLASH)
    p = plan(needs, 3 * GB)
    assert p.planned_bytes <= 3 * GB  # the whole process, overhead included
    assert 0 < p.pinned_layers < FLASH.n_layers and p.ring_slots == 2
    assert p.ring_slot_bytes == max(needs.layer_bytes)
    assert p.expert_slots >= 2 * FLASH.num_experts_per_tok
    (w,) = p.warnings
    assert "working set of 258" in w and "add " in w and "--budget" in w
    assert any("layers pinned" in line for line in p.lines())


def test_flash_budget_16_pins_the_whole_trunk_and_holds_the_working_set():
    p = plan(needs_from_config(FLASH), 16 * GB)
    assert p.pinned_layers == FLASH.n_layers and p.ring_slots == 0
    assert p.expert_slots > FLASH.working_set_experts and not p.warnings
    assert p.planned_bytes <= 16 * GB


def test_flash_at_budget_16_and_8192_positions_counts_by_hand():
    """What a 4096+-token prompt costs on the released V4-Flash config, figured by hand from
    config.json (hidden 4096, hc 4, 6 of 256 experts, head_dim 512, index_head_dim 128, 64
    heads, window 128, vocab 129280; 21 layers at ratio 4, 20 at 128, 2 window-only)."""
    needs = needs_from_config(FLASH, ctx=8192)
    # per segment token: 4 * (hc*D + (k+5)*D + 3*E + hc + hc^2) + 3 * 8
    assert needs.segment_token_bytes == 4 * (16384 + 45056 + 768 + 4 + 16) + 24 == 248_936
    # window ring per layer: 128 rows x 512 float32 + 128 int64 positions = 263,168 (x 43)
    # ratio 4: 8192 // 4 + 1 = 2049 rows -> allocated 2049 + 2049 // 8 = 2305 rows;
    #   main rows 2305 * 512 * 4 = 4,720,640, open window 2 * 4 * 1024 * 4 = 32,768, overlap
    #   2 * 4 * 512 * 4 = 16,384; indexer 2305 * 128 * 4 = 1,180,160 + 8,192 + 4,096 (x 21)
    # ratio 128: 65 rows -> 73 allocated: 73 * 512 * 4 = 149,504, open window 2 * 128 * 512 * 4 (x 20)
    # one buffer's old copy while it grows: 4,720,640
    state = 43 * 263_168 + 21 * (4_720_640 + 32_768 + 16_384 + 1_180_160 + 8_192 + 4_096)
    state += 20 * (149_504 + 524_288) + 4_720_640
    assert needs.state_bytes == state == 154_719_744
    # a 64-token sub-chunk: 4 * (3*hc*D + 3*H*hd + 4*inter + vocab) + 4 * (4*H*(128 + 64 + 512 + 1)
    # + 4 * 2049) per token, the head's two logits rows, two 16 MiB blocks
    per_token = 4 * (49152 + 98304 + 8192 + 129280) + 4 * (4 * 64 * 705 + 4 * 2049)
    assert needs.staging_bytes == 64 * per_token + 4 * 129280 * 2 + 2 * 16 * 2**20 == 155_831_296
    p = plan(needs, 16 * GB)
    assert p.prefill_segment == 4096 and p.segment_bytes == 4096 * 248_936 == 1_019_641_856
    assert p.pinned_layers == FLASH.n_layers
    fixed = needs.overhead_bytes + state + needs.staging_bytes + needs.head_bytes
    # the pool expert slots and the segment share: the budget after the fixed part and the trunk;
    # 7,643,935,012 with the 240 MB overhead of two changes ago, 20,000,000 less with 260 MB
    pool = 16 * GB - fixed - sum(needs.layer_bytes)
    assert p.pool_bytes == pool == 7_643_935_012 - 20_000_000 == 7_623_935_012 and needs.slot_bytes == 13_385_728
    # decoding: every slot beside one token's activations: 7,623,686,076 bytes = 569 x 13,385,728
    # (7,616,479,232) + 7,206,844; a 4096-token segment borrows 76 of them: 6,604,293,156 bytes
    # = 493 x 13,385,728 (6,599,163,904) + 5,129,252
    assert p.expert_slots == (pool - 248_936) // 13_385_728 == 569
    assert p.prefill_slots(1) == 569 and p.prefill_slots(4096) == (pool - 1_019_641_856) // 13_385_728 == 493
    # the larger phase is what is planned: here the prefill, 493 slots beside the 4096-token segment
    # (6,599,163,904 + 1,019,641,856 = 7,618,805,760), against decode's 569 slots beside one token
    # (7,616,479,232 + 248,936 = 7,616,728,168); the rest (5,129,252) is less than one more slot
    assert p.planned_bytes == fixed + sum(needs.layer_bytes) + 493 * 13_385_728 + 1_019_641_856
    assert 0 <= 16 * GB - p.planned_bytes < needs.slot_bytes


def test_too_small_a_budget_names_the_minimum():
    needs = needs_from_config(FLASH)
    floor = minimum_budget(needs)
    assert 1.5 * GB < floor < 2.5 * GB  # head (1.06 GB) + overhead + a two-layer ring + 12 slots
    with pytest.raises(BudgetError, match=r"below the minimum of \d+\.\d\d GB"):
        plan(needs, floor - 1)
    assert plan(needs, floor).pinned_layers == 0


def test_more_budget_never_gives_less():
    needs = needs_from_config(FLASH)
    prev = None
    for gb in (2.1, 3, 4, 6, 8, 10, 12, 16, 32, 160):  # from just above the minimum, 2.09 GB
        p = plan(needs, int(gb * GB))
        if prev is not None:
            assert p.pinned_layers >= prev.pinned_layers and p.pool_bytes + p.pinned_bytes > prev.pool_bytes
            # the pool shrinks only where one more layer is pinned (the ring then reads one layer less)
            if p.pinned_layers == prev.pinned_layers:
                assert p.prefill_segment >= prev.prefill_segment and p.expert_slots >= prev.expert_slots
        prev = p
    assert prev.expert_slots == FLASH.n_layers * FLASH.n_routed_experts  # capped at every expert


def test_pins_layers_in_order_before_adding_expert_slots():
    needs = MemoryNeeds(
        layer_bytes=(100, 100, 300, 300), head_bytes=50, slot_bytes=10, state_bytes=5, staging_bytes=5,
        overhead_bytes=40, working_set=6, experts_per_token=2, total_experts=30,
    )  # fmt: skip
    # fixed 100 + 4 minimum slots (40) + a ring of 2 x 300 (600) is the floor
    assert minimum_budget(needs) == 740
    p = plan(needs, 840)  # 100 spare after the ring: layer 0 pinned, nothing left for slots
    assert (p.pinned_layers, p.ring_slots, p.expert_slots) == (1, 2, 4)
    p = plan(needs, 940)  # the whole trunk (800) fits: no ring at all
    assert (p.pinned_layers, p.ring_slots, p.expert_slots) == (4, 0, 4)
    p = plan(needs, 965)  # what is left after the trunk goes to expert slots
    assert (p.pinned_layers, p.ring_slots, p.expert_slots) == (4, 0, 6)
    assert p.warnings == () and plan(needs, 840).warnings  # 4 slots < working set 6


def test_budget_for_is_the_smallest_budget_by_hand():
    """Figures worked out by hand from the split rules (fixed part, minimum slots, ring, layers
    in order, slots to the working set, the segment, then slots), to the byte."""
    needs = MemoryNeeds(
        layer_bytes=(100, 100, 300, 300), head_bytes=50, slot_bytes=10, state_bytes=5, staging_bytes=5,
        overhead_bytes=40, working_set=6, experts_per_token=2, total_experts=30,
    )  # fmt: skip
    # whole trunk: fixed 100 + layers 800 + 6 slots x 10
    assert budget_for(needs, 6) == 960
    # layer 0 pinned: the floor 740 (ring 600 included) + 100; then 10 per slot past the 4
    assert [budget_for(needs, n, pinned=1) for n in (4, 5, 10, 12)] == [840, 850, 900, 920]
    # 13 slots with one layer pinned would need 930, but at 930 layer 1 still does not fit
    # (780 free < 800 + ring): 13 slots at 930; at 940 the whole trunk fits, which also counts
    assert budget_for(needs, 13, pinned=1) == 930 and budget_for(needs, 14, pinned=1) == 940
    # with a prefill segment costing 1 byte per token, from 1 token: the slots and the segment
    # share the pool; decoding, every slot beside one token; prefilling, the longest segment
    # beside two slots (PREFILL_SLOTS)
    seg = MemoryNeeds(
        layer_bytes=(100, 100), head_bytes=50, slot_bytes=10, state_bytes=5, staging_bytes=5,
        overhead_bytes=40, working_set=6, experts_per_token=2, total_experts=30,
        segment_token_bytes=1, segment_min=1,
    )  # fmt: skip
    assert budget_for(seg, 6) == 100 + 200 + 6 * 10 + 1
    assert budget_for(seg, 7) == 100 + 200 + 7 * 10 + 1 == 371
    p = plan(seg, 380)  # pool 80: 7 slots and 9 bytes, or 2 slots beside a 60-token segment
    assert (p.pool_bytes, p.expert_slots, p.prefill_segment) == (80, 7, 60)
    assert [p.prefill_slots(n) for n in (1, 9, 10, 11, 60)] == [7, 7, 7, 6, 2]  # the slots lent back at decode
    assert p.planned_bytes == 380 and "in the bytes of 5 expert slots until decode" in "\n".join(
        p.lines()
    )  # prefill's phase
    # all 30 experts fit: the rest of the pool goes to the segment without lending, up to SEGMENT_CAP
    big = plan(seg, 300 + 300 + 500)
    assert (big.expert_slots, big.prefill_segment, big.prefill_slots(500)) == (30, 780, 30)
    assert plan(seg, 10**6).prefill_segment == SEGMENT_CAP


def test_state_grows_with_context():
    assert state_bytes_for(FLASH, 65536) > state_bytes_for(FLASH, 4096) > 0


def test_inspect_config_only_prints_the_plan_for_a_budget():
    from click.testing import CliRunner

    from dsv4stream.cli.inspect import inspect

    cfg_path = Path(__file__).resolve().parents[1] / "dsv4stream" / "v4_flash_config.json"
    r = CliRunner().invoke(inspect, ["--config-only", str(cfg_path), "--budget", "3", "--numerics", "exact"])
    assert r.exit_code == 0, r.output
    # exact (the BF16 head resident) fixed: overhead 260,000,000 + state 88,954,368 + staging 154,782,720 + head 1,077,948,436
    # = 1,581,685,524; the smallest pool 2 x 6 slots x 13,385,728 + one token's 248,936 = 160,877,672;
    # the ring 2 x 173,503,576 = 347,007,152. 3 GB leaves 910,429,652 for layers in order: 143,596,888
    # + 143,596,888 + 173,503,576 + 146,044,248 + 167,299,160 = 774,040,760 (5 layers); a 6th
    # (146,044,248) would make 920,085,008. The pool left, 910,429,652 - 774,040,760 + 160,877,672
    # = 297,266,564, less one token's 248,936, is 22 slots (294,486,016) and 2,531,612 over
    assert "budget 3.00 GB" in r.output and "5/43 layers pinned" in r.output and "working set of 258" in r.output
    assert "22 slots x 13.4 MB" in r.output  # one V4-Flash expert slot
    r = CliRunner().invoke(inspect, ["--config-only", str(cfg_path), "--budget", "1", "--numerics", "exact"])
    # the minimum: fixed + ring + smallest pool = 1,581,685,524 + 347,007,152 + 160,877,672
    # = 2,089,570,348, printed rounded up
    assert isinstance(r.exception, BudgetError) and "below the minimum of 2.09 GB" in str(r.exception)


def test_inspect_config_only_plans_fasts_int8_head_copy():
    """fast (inspect's default, as `dsv4 run`'s) on a CPU that runs the copy's kernels: the copy
    resident and the BF16 head on disk (no drafter in the preview layout)."""
    from click.testing import CliRunner

    from dsv4stream import kernels
    from dsv4stream.cli.inspect import inspect

    if not kernels.head.copy_runs():
        pytest.skip("this CPU or backend reads the BF16 head under fast")
    cfg_path = Path(__file__).resolve().parents[1] / "dsv4stream" / "v4_flash_config.json"
    r = CliRunner().invoke(inspect, ["--config-only", str(cfg_path), "--budget", "3"])
    assert r.exit_code == 0, r.output
    # the head 1,077,948,436 less its BF16 matrix 129,280 x 4,096 x 2 = 1,059,061,760 plus the copy
    # 530,051,072 (int8 rows, then 4-byte scales, each part padded to 4096) = 548,937,748; fixed
    # 1,052,674,836. 3 GB less fixed, the ring 347,007,152 and the smallest pool 160,877,672 leaves
    # 1,439,440,340: 9 layers (1,400,727,576; a 10th is 146,044,248); the pool 38,712,764 +
    # 160,877,672, less one token's 248,936, is 14 slots of 13,385,728
    assert "head 0.55 GB (its int8 copy 0.53 GB for fast's logits; the BF16 head 1.06 GB on disk" in r.output
    assert "9/43 layers pinned" in r.output and "14 slots x 13.4 MB" in r.output
    assert "smallest budget that runs: 1.57 GB" in r.output  # 1,052,674,836 + 347,007,152 + 160,877,672


def test_config_estimate_matches_what_a_run_measures(tmp_path):
    """`inspect --config-only --budget` and `doctor` plan from config.json alone: their sizes
    must agree with what `dsv4 run` measures on the shards (within 2%)."""
    from dsv4stream import synth
    from dsv4stream.run.memory import measure
    from dsv4stream.run.runinfo import RunOptions

    ckpt = synth.make_checkpoint(tmp_path / "c", "tiny", seed=3, hidden_size=256, moe_intermediate_size=256)
    opts = RunOptions(budget=GB, trunk="")
    got = measure(ckpt, opts)
    est = needs_from_config(ModelConfig.from_json(ckpt / "config.json"), ctx=opts.ctx, chunk=opts.chunk)
    for a, b in zip(got.layer_bytes, est.layer_bytes, strict=True):
        assert abs(a - b) <= 0.02 * a + 8192
    assert abs(got.head_bytes - est.head_bytes) <= 0.02 * got.head_bytes + 8192
    assert abs(got.slot_bytes - est.slot_bytes) <= 2 * 4096
    assert got.state_bytes == est.state_bytes and got.working_set == est.working_set
