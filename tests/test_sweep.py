"""The live sweep's plumbing, with a stand-in for `dsv4 run` (tests/fake_dsv4_run.py)."""

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsv4stream.cli.bench import bench
from dsv4stream.errors import Dsv4Error
from dsv4stream.measure import sweep
from dsv4stream.synth import release_config

FAKE = (sys.executable, str(Path(__file__).with_name("fake_dsv4_run.py")))


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "DSV4", FAKE)
    d = tmp_path / "ckpt"
    d.mkdir()
    cfg = release_config("tiny")
    cfg[sweep.GENERATOR_KEY] = {"preset": "tiny", "seed": 0, "route_skew": 1.5}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_sweep_writes_csv_json_png_with_one_row_per_budget(checkpoint, tmp_path):
    out = tmp_path / "out"
    res = CliRunner().invoke(bench, [str(checkpoint), "--budgets", "2,0.4,0.8", "--gen", "12", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "bench.json").read_text())
    rows = data["results"]
    assert [r["budget_gb"] for r in rows] == [0.4, 0.8, 2.0]
    assert [r["cache_slots"] for r in rows] == [4, 8, 20]
    assert rows[0]["hit_rate"] == 0.0 < rows[1]["hit_rate"] < rows[2]["hit_rate"]
    assert all(r["replay_matches"] and r["replay_belady_hits"] >= r["expert_hits"] for r in rows)
    assert rows[0]["os_peak_rss_bytes"] + 100e6 < rows[2]["os_peak_rss_bytes"]  # each budget its own process
    assert rows[1]["prefill_tok_s"] == 10.0 and rows[2]["read_gbps"] == 1.5 and rows[2]["exposed_io_seconds"] == 0.05
    assert data["generated_ids"] == list(range(100, 112)) and data["generator"]["route_skew"] == 1.5
    assert "skewed routing (route_skew 1.5" in data["routing"] and "skewed routing" in res.output
    assert (out / "bench.csv").read_text().count("\n") == 4
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "budget-0.8" / "route.log").exists() and "--io direct" in (out / "budget-0.8" / "run.log").read_text()
    assert "token ids identical at every budget" in res.output


def test_sweep_fails_loudly_when_token_ids_differ(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_DIFF_AT", "0.8")
    with pytest.raises(
        Dsv4Error, match=r"differ between --budget 0.4 and --budget 0.8 at generated token 1 \(101 vs 102\)"
    ):
        sweep.sweep(checkpoint, [0.4, 0.8], ["--prompt", "hi"], 4, tmp_path / "out")


def test_a_failed_run_names_its_budget_and_log(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1")
    with pytest.raises(Dsv4Error, match=r"--budget 1 failed \(exit 2\): dsv4: something went wrong — see .*run.log"):
        sweep.sweep(checkpoint, [1], ["--prompt", "hi"], 4, tmp_path / "out")


def test_routing_kind_says_what_it_ran_on():
    from dsv4stream.checkpoint.config import ModelConfig

    cfg = release_config("tiny")
    assert "own routing" in sweep.routing_kind(ModelConfig.from_dict(cfg))
    cfg[sweep.GENERATOR_KEY] = {"route_skew": 0}
    assert "uniform" in sweep.routing_kind(ModelConfig.from_dict(cfg))
