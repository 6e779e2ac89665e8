"""Running `dsv4` for the CLI tests: `stats_of` (`dsv4 run` in-process at `--budget 1`: the
--stats-json document it wrote, and the result), `dsv4` (the command in a child process) and
`refused` (a bad input's answer: one line `dsv4: ...`, exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from dsv4stream.cli.run import run as run_cmd


def _invoke(*args: str, input: str | None = None):
    res = CliRunner().invoke(run_cmd, [*args, "--budget", "1"], input=input, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res


def stats_of(tmp_path: Path, *args: str, input: str | None = None) -> tuple[dict, object]:
    out = tmp_path / f"s{len(list(tmp_path.iterdir()))}.json"
    res = _invoke(*args, "--stats-json", str(out), input=input)
    return json.loads(out.read_text()), res


def dsv4(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from dsv4stream.cli import main; main()", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def refused(r: subprocess.CompletedProcess, *words: str) -> str:
    """The one line a refused command printed, holding each of `words` (asserted with exit 2)."""
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    assert r.returncode == 2 and last.startswith("dsv4: ") and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in last, (w, last)
    return last
