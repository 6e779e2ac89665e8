"""The first `dsv4 run` on a cold numba cache: compile time against its estimate, peak RSS
against `--budget`.

Points NUMBA_CACHE_DIR at an empty temporary folder (a fresh installation), then runs
`/usr/bin/time -v dsv4 run CHECKPOINT --prompt-ids ... --budget B --stats-json F` once.
The run compiles the kernels its checkpoint needs in child processes (`run/compile.py`), so
the budgeted process only loads them from the cache. Timed windows: the whole command, and
the compile as the run reports it. Prints the checkpoint's kernel forms, the number of
kernels, the children, the estimate the run showed and the compile's measured wall time, the
CPU time of the whole command (children included), the run's own peak (VmHWM, from
--stats-json) and GNU time's maximum resident set (the largest of the run and a child).

With `--units`, instead compiles every unit of every form (`kernels.warm.units`) one after
another in this process on an empty cache and prints each one's CPU seconds as the lines of
`kernels.warm.COST` (the table the split and the estimate use).

Usage: bench/cold_compile.py CHECKPOINT [--budget GB] [--gen N]
       bench/cold_compile.py --units
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


def units() -> None:
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp()
    from dsv4stream.kernels import set_backend, warm
    from dsv4stream.measure.machine import cpu_description

    set_backend("fast")
    print(f"# {cpu_description()}; load {os.getloadavg()[0]:.2f}; CPU seconds per unit, one process, empty cache")
    total = 0.0
    for u in warm.units(warm.FORMS):
        c = time.process_time()
        warm.warm_unit(u)
        took = time.process_time() - c
        total += took
        print(f'    "{u}": {took:.2f},', flush=True)
    print(f"# total {total:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="?")
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--gen", type=int, default=4)
    ap.add_argument("--units", action="store_true", help="print each unit's compile seconds instead")
    a = ap.parse_args()
    if a.units:
        units()
        return
    if not a.checkpoint:
        ap.error("a checkpoint is needed (or --units)")
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
        cpu = sum(float(v) for v in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", r.stderr))
        said = re.search(r"compiling (\d+) numba kernels .*? in (\d+) separate process.*?about (\d+) s", r.stderr)
        took = re.search(r"compiled (\d+) kernels in ([\d.]+) s", r.stderr)
    if said is None or took is None:
        sys.exit("the run compiled nothing: was the cache warm?")
    print(
        f"cold numba cache: {said.group(1)} kernels in {said.group(2)} children, estimate shown {said.group(3)} s,"
        f" compile measured {float(took.group(2)):.1f} s; whole command {wall:.1f} s wall, {cpu:.1f} s CPU;"
        f" run peak {s['peak_rss_bytes'] / 1e9:.3f} GB of --budget {a.budget:.3f} GB"
        f" ({s['peak_rss_bytes'] / (a.budget * 1e9):.0%}); /usr/bin/time max RSS {tree / 1e9:.3f} GB"
        f" (largest of run and compile children); load {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
