"""`dsv4 inspect`: in-process through click's CliRunner, and as the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsv4stream import synth
from dsv4stream.cli.inspect import inspect
from dsv4stream.errors import CheckpointError, ConfigError

FLASH = synth.FLASH_CONFIG
DSV4 = Path(sys.executable).with_name("dsv4")


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return synth.make_checkpoint(tmp_path_factory.mktemp("i") / "good", "tiny", seed=0)


@pytest.fixture(scope="module")
def broken(good, tmp_path_factory) -> Path:
    """The good checkpoint with a config that no longer matches its shards (q_lora 32 -> 48)."""
    dst = tmp_path_factory.mktemp("i") / "broken"
    shutil.copytree(good, dst)
    p = dst / "config.json"
    p.write_text(json.dumps(dict(json.loads(p.read_text()), q_lora_rank=48)))
    return dst


def run_script(*args: str) -> subprocess.CompletedProcess:
    if not DSV4.exists():
        pytest.skip(f"console script not installed at {DSV4}")
    return subprocess.run([str(DSV4), *args], check=False, capture_output=True, text=True, timeout=60)


def test_good_checkpoint(good):
    r = CliRunner().invoke(inspect, [str(good)])
    assert r.exit_code == 0, r.output
    assert "layers: 4 main + 1 MTP; kinds: csa=2, hca=1, window=1; hash layers: 1" in r.stdout
    assert "expert bytes: 3,264 bytes per expert" in r.stdout  # 3 x (32x64/2 + 32x64/32)
    assert "working set per pass: 8 experts" in r.stdout
    assert "checkpoint: 427 tensors in 5 shards" in r.stdout
    assert "all tensors present with the expected dtype and shape" in r.stdout


def test_broken_checkpoint_lists_problems(broken):
    r = CliRunner().invoke(inspect, [str(broken)])
    assert r.exit_code != 0
    assert isinstance(r.exception, CheckpointError)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("  problem: ")]
    assert "  problem: 'layers.0.attn.wq_a.weight': shape [32, 64], expected [48, 64]" in lines
    assert "  problem: 'layers.0.attn.q_norm.weight': shape [32], expected [48]" in lines
    assert len(lines) > 10
    assert "tensor problem(s) listed above" in str(r.exception)


def test_config_only_flash():
    for args in ([str(FLASH)], ["--config-only", str(FLASH)]):
        r = CliRunner().invoke(inspect, args)
        assert r.exit_code == 0, r.output
        assert "258 experts" in r.stdout
        assert "13,369,344 bytes per expert" in r.stdout
        assert "3.21 GiB" in r.stdout
        assert "kinds: csa=21, hca=20, window=2; hash layers: 3" in r.stdout


def test_config_only_on_a_directory(good):
    r = CliRunner().invoke(inspect, ["--config-only", str(good)])
    assert r.exit_code == 0 and "checkpoint:" not in r.stdout and "3,264 bytes" in r.stdout


def test_bad_config_raises(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"hidden_size": 64}))
    r = CliRunner().invoke(inspect, [str(p)])
    assert isinstance(r.exception, ConfigError) and "no 'model_type'" in str(r.exception)
    p.write_text(json.dumps({"model_type": "deepseek_v4", "hidden_size": 64}))
    r = CliRunner().invoke(inspect, [str(p)])
    assert isinstance(r.exception, ConfigError) and "missing 'vocab_size'" in str(r.exception)


def test_console_script(good, broken):
    r = run_script("inspect", str(good))
    assert r.returncode == 0, r.stderr
    assert "all tensors present" in r.stdout
    r = run_script("inspect", str(broken))
    assert r.returncode == 2
    assert "  problem: 'layers.0.attn.wq_a.weight': shape [32, 64], expected [48, 64]" in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("dsv4: ") and "tensor problem(s)" in last and "Traceback" not in r.stderr
    r = run_script("inspect", "--config-only", str(FLASH))
    assert r.returncode == 0
    assert "258 experts" in r.stdout and "13,369,344 bytes" in r.stdout and "3.21 GiB" in r.stdout
    r = run_script("inspect", str(good.parent / "does-not-exist"))
    assert r.returncode == 2 and r.stderr.startswith("dsv4: ") and "not found" in r.stderr
