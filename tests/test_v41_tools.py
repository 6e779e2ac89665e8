"""pack-trunk, inspect, doctor and the planner on DeepSeek-V4.1 checkpoints and configs."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.checkpoint.config import ModelConfig
from dsv4stream.checkpoint.spec_v41 import is_vision
from dsv4stream.cli.doctor import doctor
from dsv4stream.cli.inspect import inspect
from dsv4stream.cli.pack import pack_trunk_cmd as pack_trunk
from dsv4stream.run import planner
from dsv4stream.run.memory import measure, needs_of
from dsv4stream.run.planner import ENGRAM_SHARE, GB, needs_from_config, plan
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.store.rowcache import ROW_INDEX_BYTES
from dsv4stream.streaming.layout import trunk_layout
from dsv4stream.trunkpack.reader import TrunkFile

RELEASED = Path(__file__).resolve().parents[1] / "dsv4stream" / "v41_flash_config.json"


@pytest.fixture(scope="module")
def packed(tiny_v41, tmp_path_factory) -> Path:
    ck = tmp_path_factory.mktemp("v41pack") / "ck"
    shutil.copytree(tiny_v41, ck)
    r = CliRunner().invoke(pack_trunk, [str(ck)])
    assert r.exit_code == 0, r.output
    return ck


def test_pack_trunk_packs_the_dense_trunk_only(packed):
    cat = Catalog.open(packed)
    tf = TrunkFile.open(packed / "dsv4-trunk", cat, verify=True)
    names = {t.name for run in tf.runs.values() for t in run.tensors}
    cfg = cat.config
    assert set(tf.runs) == {"embed", "model", "head", *(f"layers.{i}" for i in range(cfg.n_layers))}
    assert not [n for n in names if n.startswith("mtp.") or is_vision(n) or ".ffn.experts." in n]
    assert not [n for n in names if ".engram.embed." in n]  # Engram tables stream by row
    for layer in cfg.engram.layer_ids:  # the Engram module's dense part is the layer's
        assert {f"layers.{layer}.engram.wkv.weight", f"layers.{layer}.engram.q_weight"} <= names
    assert "layers.6.attn.indexer.wk.weight" in names and "layers.6.attn.compressor.wgate.weight" not in names
    # every packed tensor is byte-identical to the shard's
    for name in ("layers.4.engram.wkv.scale", "layers.2.attn.compressor.wgate.weight", "head.weight"):
        t = tf.entry(name)
        with open(tf.path, "rb") as f:
            f.seek(t.offset)
            assert f.read(t.nbytes) == cat.read(name).tobytes()
    # the streamed trunk reads V4.1's layers from the pack
    layout = trunk_layout(cat, tf)
    assert layout.packed and len(layout.layers) == cfg.n_layers
    assert "layers.1.engram.wkv.weight" in layout.layers[1].entries


def test_inspect_reports_the_v41_checkpoint(packed):
    r = CliRunner().invoke(inspect, [str(packed), "--budget", "1"])
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "model: DeepSeek-V4.1 (model_type deepseek_v41)" in out
    assert "shared attention: kv sources [2, 4, 6] (own a compressor), index sources [2, 4, 6, 8]" in out
    assert "engram: layers [1, 4]" in out and "vision tower (vision.*, 2 blocks" in out
    assert "all tensors present with the expected dtype and shape" in out and "every checksum verified" in out
    assert "  engram: row cache" in out


def test_measured_needs_know_the_engram_and_the_unused_parts(tiny_v41):
    needs = measure(tiny_v41, RunOptions(budget=GB))
    cat = Catalog.open(tiny_v41)
    e = cat.config.engram
    assert needs.engram_slot_bytes == e.row_bytes + ROW_INDEX_BYTES and needs.engram_rows_per_token == e.columns * 2
    assert needs.engram_table_bytes == sum(x.nbytes for n, x in cat.entries.items() if ".engram.embed." in n)
    assert "DSpark drafter" not in needs.unused  # --speculate auto (the default) runs it: planned
    off = measure(tiny_v41, RunOptions(budget=GB, speculate="off"))
    assert "DSpark drafter (mtp.0-2, 3 stages): run by --speculate (default auto); with --speculate off" in off.unused
    assert "vision tower" in needs.unused
    # no hc_head in V4.1: the head group is the head and the final norm
    head = trunk_layout(cat).head.entries
    assert set(head) == {"head.weight", "norm.weight"}
    assert needs.head_bytes >= head["head.weight"].nbytes + head["norm.weight"].nbytes


def test_released_config_plans_at_four_budgets():
    cfg = ModelConfig.from_json(RELEASED)
    needs, how = needs_of(RELEASED)
    assert how.startswith("estimated from config.json")
    assert sum(needs.layer_bytes) == 7_199_094_208 - 5120 * 2  # the main layers; the final norm is the head's
    assert needs.head_bytes == 129280 * 5120 * 2 + 5120 * 2
    assert needs.slot_bytes >= cfg.expert_bytes == 18_800_640 and needs.working_set == 240
    rows = {}
    for b in (12, 16, 24, 32):
        p = plan(needs, b * GB)
        assert p.planned_bytes <= b * GB and p.pinned_layers == 40
        assert p.engram_rows == int(b * GB * ENGRAM_SHARE) // needs.engram_slot_bytes
        rows[b] = p.engram_rows
        text = "\n".join(p.lines())
        assert f"engram: row cache {p.engram_rows:,} rows x 328 B" in text and "48 rows per token" in text
    assert rows[12] < rows[16] < rows[24] < rows[32]
    assert plan(needs, 12 * GB).expert_slots < 240 <= plan(needs, 16 * GB).expert_slots


def test_engram_rows_come_before_expert_slots_short_of_the_working_set():
    needs = needs_from_config(ModelConfig.from_json(RELEASED))
    p = plan(needs, 12 * GB)
    assert p.engram_rows > 0 and p.expert_slots < needs.working_set
    fixed = planner.MemoryNeeds(**{**needs.__dict__, "engram_rows": 10**9})
    q = plan(fixed, 12 * GB)
    assert any("Engram row cache holds" in w for w in q.warnings)


def test_a_v41_checkpoint_opens_and_runs(tiny_v41):
    from dsv4stream.engine.session import Engine

    eng = Engine.open(tiny_v41)
    out = eng.session().prefill(np.arange(1, 9))
    assert out.shape == (8, eng.cfg.vocab_size) and np.isfinite(out).all()


def test_doctor_on_a_v41_checkpoint_measures_engram_reads(tiny_v41):
    r = CliRunner().invoke(doctor, [str(tiny_v41), "--seconds", "0.05", "--depths", "1"])
    assert r.exit_code == 0, r.output
    assert "model: DeepSeek-V4.1, 10 layers" in r.stdout
    assert "engram rows:" in r.stdout and "random 4 KiB reads/s" in r.stdout
    assert "engram: 12 rows per token" in r.stdout
