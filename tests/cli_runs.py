"""`dsv4 run` in-process at `--budget 1`, for the CLI tests: the result, or the --stats-json
document it wrote and the result."""

from __future__ import annotations

import json
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
