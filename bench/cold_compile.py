"""Peak RSS of the first `dsv4 run` on a cold numba cache, against its `--budget`.

Points NUMBA_CACHE_DIR at an empty temporary folder (a fresh installation), then runs
`/usr/bin/time -v dsv4 run CHECKPOINT --prompt-ids ... --budget B --stats-json F` once.
The run compiles the kernels in a child process (`runtime.compile_kernels_apart`), so the
budgeted process only loads them from the cache. Timed window: the whole command. Prints
one line: the run's own peak (VmHWM, from --stats-json), GNU time's maximum resident set
(the largest of the run and its compile child), the budget, and the compile's wall time.

Usage: bench/cold_compile.py CHECKPOINT [--budget GB] [--gen N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = "from dsv4stream.cli import main; main()"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--gen", type=int, default=4)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        stats = Path(d) / "stats.json"
        env = dict(os.environ, NUMBA_CACHE_DIR=str(Path(d) / "numba"))
        cmd = ["/usr/bin/time", "-v", sys.executable, "-c", CHILD, "run", a.checkpoint, "--prompt-ids", "1,2,3"]
        cmd += ["--gen", str(a.gen), "--budget", f"{a.budget:g}", "--stats-json", str(stats)]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            sys.exit(f"run failed: {r.stderr.strip().splitlines()[-1]}")
        s = json.loads(stats.read_text())
        tree = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1)) * 1024
        child = "separate process" in r.stderr
    print(
        f"cold numba cache: run peak {s['peak_rss_bytes'] / 1e9:.3f} GB of --budget {a.budget:.3f} GB"
        f" ({s['peak_rss_bytes'] / (a.budget * 1e9):.0%}); /usr/bin/time max RSS {tree / 1e9:.3f} GB"
        f" (largest of run and compile child); compiled in a child: {child}; whole command {wall:.1f} s"
    )


if __name__ == "__main__":
    main()
