"""Running `dsv4` for the CLI tests: `stats_of` (`dsv4 run` in-process at `--budget 1`: the
--stats-json document it wrote, and the result), `dsv4` (the whole command, `main()` with its
error lines and exit codes, in this process), `dsv4_child` (the same in a child process, for
what only a process shows: the entry point, rlimits, signals) and `refused` (a bad input's
answer: one line `dsv4: ...`, exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from dsv4stream.cli import main
from dsv4stream.cli.run import run as run_cmd


def _invoke(*args: str, input: str | None = None):
    res = CliRunner().invoke(run_cmd, [*args, "--budget", "1"], input=input, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res


def stats_of(tmp_path: Path, *args: str, input: str | None = None) -> tuple[dict, object]:
    out = tmp_path / f"s{len(list(tmp_path.iterdir()))}.json"
    res = _invoke(*args, "--stats-json", str(out), input=input)
    return json.loads(out.read_text()), res


def dsv4(*args: str, input: str | bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """`dsv4 ARGS` run by `main()` in this process, stdout and stderr captured apart (text), its
    exit code as a child's would be: a child costs 1.3-2.8 CPU-s of imports and kernel-cache
    loading before it starts. `env`: variables set (None: unset) for the call. An exception
    `main()` lets through (a programming error: a child's traceback) fails the test here."""
    with CliRunner().isolation(input=input, env=env) as (out, err, _):
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    return subprocess.CompletedProcess(["dsv4", *args], code, stdout, stderr)


def dsv4_child(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`dsv4 ARGS` in a child process (text)."""
    cmd = [sys.executable, "-c", "from dsv4stream.cli import main; main()", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def refused(r: subprocess.CompletedProcess, *words: str) -> str:
    """The one line a refused command printed, holding each of `words` (asserted with exit 2)."""
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    assert r.returncode == 2 and last.startswith("dsv4: ") and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in last, (w, last)
    return last
