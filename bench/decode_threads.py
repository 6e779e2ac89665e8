"""Decode speed with the thread count fixed and chosen by timing, quiet and with one core busy.

    python bench/decode_threads.py CHECKPOINT [--budget 10] [--gen 64] [--rounds 2]

Per round, quiet and then with a busy core (a child process spinning in `while True: pass`,
started before the runs and killed after them): one `dsv4 run CHECKPOINT --prompt-ids
1,2,3,4,5 --gen N --greedy --budget B` per mode, the modes alternating: `--threads` all usable
CPUs, no `--threads` (decode steps choose their count: `engine/threads.py`), and `--threads 1`.
Timed window: the run's own `decode_tokens_per_second` (`--stats-json`: decode steps only, no
prefill, no compile). Prints one line per run with the steps per thread count the run chose,
and fails (exit 1) unless every run's ids are the same. The checkpoint should fit the budget:
the first run of each process reads its experts (from the page cache after the first run).
Prints CPU model, SIMD flags and load before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from decode_floor import machine  # bench/ is on sys.path: the script's own folder


def run(ckpt: Path, budget: float, gen: int, threads: int | None, out: Path) -> dict:
    cmd = [sys.executable, "-c", "from dsv4stream.cli import main; main()", "run", str(ckpt)]
    cmd += ["--prompt-ids", "1,2,3,4,5", "--gen", str(gen), "--greedy", "--budget", str(budget)]
    cmd += ["--stats-json", str(out)] + (["--threads", str(threads)] if threads else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--budget", type=float, default=10.0)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    most = len(os.sched_getaffinity(0))
    modes = [(f"threads={most}", most), ("chosen", None), ("threads=1", 1)]
    print(f"# {machine()}", flush=True)
    ids = set()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stats.json"
        for busy in (False, True):
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                for r in range(args.rounds):
                    for label, threads in modes:
                        d = run(args.checkpoint, args.budget, args.gen, threads, out)
                        ids.add(tuple(d["generated_ids"]))
                        chose = d["decode_threads"] or {}
                        print(
                            f"{'busy core' if busy else 'quiet'} round {r + 1} {label}: decode"
                            f" {d['decode_tokens_per_second']:.2f} tok/s"
                            + (f", steps per thread count {chose}" if chose else ""),
                            flush=True,
                        )
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
    print(f"# {machine()}; ids identical in every run: {'yes' if len(ids) == 1 else 'NO'}")
    return 0 if len(ids) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
