"""The benches' memory limit (measure/memlimit.py): a cgroup of its own, with the page cache counted."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from dsv4stream.errors import UsageError
from dsv4stream.measure import memlimit

GROW = "import sys; x = bytearray(int(sys.argv[1]) << 20); x[::4096] = b'1' * len(x[::4096]); print(len(x) >> 20)"


def limited(mb_used: int, mb_limit: int) -> memlimit.Limited:
    try:
        return memlimit.run_limited([sys.executable, "-c", GROW, str(mb_used)], mb_limit << 20, timeout=120)
    except UsageError as e:
        pytest.skip(f"no cgroup can be created here: {e}")


def test_a_command_over_the_limit_is_killed_and_one_under_it_runs() -> None:
    over = limited(160, 96)
    assert over.oom_killed and over.returncode != 0
    under = limited(64, 256)
    assert under.returncode == 0 and under.stdout.strip() == "64" and not under.oom_killed
    assert 64 << 20 <= under.peak_bytes <= 256 << 20


def test_the_cgroup_folder_is_removed_after_the_run() -> None:
    try:
        parent, _ = memlimit._own_cgroup()
    except UsageError as e:
        pytest.skip(str(e))
    before = {p.name for p in parent.iterdir() if p.name.startswith("dsv4-limit-")}
    limited(8, 128)
    after = {p.name for p in parent.iterdir() if p.name.startswith("dsv4-limit-")}
    assert after == before


@pytest.mark.skipif(shutil.which("fincore") is None, reason="util-linux fincore is not installed")
def test_evict_drops_a_files_cached_pages(tmp_path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"\1" * (8 << 20))
    f.read_bytes()  # in the page cache now

    def cached() -> int:
        out = subprocess.run(["fincore", "-bno", "RES", str(f)], capture_output=True, text=True, check=True).stdout
        return int(out.split()[0])

    assert cached() > 0
    memlimit.evict(tmp_path)
    assert cached() == 0
