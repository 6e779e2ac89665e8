"""`dsv4 doctor`: measurements run and the advice follows the planner and the model's sizes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cli_runs
import pytest
from click.testing import CliRunner

from dsv4stream.checkpoint.config import ModelConfig
from dsv4stream.cli.doctor import doctor
from dsv4stream.measure import doctor as d
from dsv4stream.run.planner import GB, needs_from_config, plan

FLASH = Path(__file__).resolve().parents[1] / "dsv4stream" / "v4_flash_config.json"


def test_read_bandwidth_on_a_temp_file(tmp_path):
    p = tmp_path / "blob"
    p.write_bytes(b"\x01" * (8 << 20))
    figs = d.read_bandwidth(p, 1 << 20, (1, 2), seconds=0.05)
    assert [f.depth for f in figs] == [1, 2]
    assert all(f.gbps > 0 and f.block == 1 << 20 for f in figs)


def test_expected_hit_rate_bands():
    assert d.expected_hit_rate(100, 258, 11008).startswith("0%")
    assert d.expected_hit_rate(int(258 * 1.63), 258, 11008) == "35-45%"
    assert d.expected_hit_rate(11008, 258, 11008).startswith("near 100%")
    assert d.expected_hit_rate(2000, 258, 11008).startswith("above 48-58%")


def test_advice_on_flash_config():
    cfg = ModelConfig.from_json(FLASH)
    needs = needs_from_config(cfg)
    lines = d.advice_lines(cfg, needs, 16 * GB)
    assert "258 experts per pass" in lines[0] and "13,369,344 bytes" in lines[0]
    rec = next(line for line in lines if line.startswith("recommended --budget "))
    # the most 16 GB leaves (85%: 13.6 GB), at the smallest budget with that plan
    gb = float(rec.split()[2].rstrip(":"))
    best = plan(needs, int(16 * GB * 0.85))
    got = plan(needs, round(gb * GB))
    assert (got.pinned_layers, got.expert_slots) == (best.pinned_layers, best.expert_slots)
    smaller = plan(needs, round((gb - 0.01) * GB))
    assert (smaller.pinned_layers, smaller.expert_slots) < (best.pinned_layers, best.expert_slots)
    assert "the most this machine leaves" in rec
    low = d.advice_lines(cfg, needs, 1 * GB)
    assert "none fits" in low[-1]


def test_doctor_command_exits_zero(tmp_path):
    r = CliRunner().invoke(doctor, [str(tmp_path), "--seconds", "0.05", "--depths", "1"])
    assert r.exit_code == 0, r.output
    assert "read bandwidth:" in r.output and "memory:" in r.output
    assert "advice below is for the released V4-Flash config" in r.output
    assert not list(tmp_path.iterdir())  # the probe file is removed


# ---- bad options and a doctor stopped while it measures --------------------------------------


def dsv4(*args: str) -> subprocess.Popen:
    code = "from dsv4stream.cli import main; main()"
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.parametrize(
    "args,words",
    [
        (["--seconds", "nan"], "--seconds nan"),
        (["--seconds", "inf"], "--seconds inf"),
        (["--seconds", "-1"], "--seconds -1"),
        (["--seconds", "0"], "--seconds 0"),
        (["--seconds", "soon"], "--seconds soon"),
        (["--depths", "0"], "--depths 0"),
        (["--depths", "1,,2"], "--depths 1,,2"),
        (["--depths", "-3"], "--depths -3"),
        (["--depths", "100000"], "--depths 100000"),
    ],
)
def test_bad_seconds_and_depths_are_one_line_at_once(tmp_path, args, words):
    if args[1] in ("nan", "inf"):  # a child, under a timeout: taken as a duration, these would never end
        p = dsv4("doctor", str(tmp_path), *args)
        _, err = p.communicate(timeout=120)
        code = p.returncode
    else:  # main() in this process: a child costs 1.3-2.8 CPU-s before it starts
        r = cli_runs.dsv4("doctor", str(tmp_path), *args)
        code, err = r.returncode, r.stderr
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("dsv4: ") and words in last and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def _probe_exists(pid: int, folder: Path) -> bool:
    """The probe file exists: by name in the folder, or open (and nameless) in the process."""
    if list(folder.iterdir()):
        return True
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return False
    return any(link.startswith(str(folder)) for link in links)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_doctor_stopped_while_it_measures_leaves_no_file(tmp_path, sig):
    folder = tmp_path / "drive"
    folder.mkdir()
    p = dsv4("doctor", str(folder), "--seconds", "30", "--depths", "1")
    deadline = time.monotonic() + 120
    while not _probe_exists(p.pid, folder):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.05)
    time.sleep(0.5)
    p.send_signal(sig)
    p.communicate(timeout=60)
    assert list(folder.iterdir()) == []
