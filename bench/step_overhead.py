"""The Python cost of a decode step and of a 7-token prefill: CPU time on a checkpoint whose
matrices are too small to matter.

    python bench/step_overhead.py [--numerics fast] [--steps 200] [--threads 1] [--tree DIR ...]

Generates (in a temporary folder) the flash-experts layout, 4 layers of 64 routed experts with
6 per token, at hidden 256, expert width 256, vocabulary 1024: every product of a flash-experts
step runs with the same calls, on weights of a few hundred kilobytes, so what a step costs is
the per-layer Python (dispatch, numpy glue, the expert source) and the kernels' call overhead.
Then one child per `--tree` (a source tree put first on the path: compare two checkouts in one
run, alternating, so a load change hits both) opens it at --threads, runs a warm-up generation,
and times in CPU seconds (`time.process_time`, every thread; robust to a shared machine's load,
unlike wall time) 5 rounds of --steps/5 greedy steps and 10 prefills of the same 7 ids in fresh
sessions. Prints per tree the best round's CPU ms per step and the best prefill, with the CPU,
SIMD, numerics and load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
ck, numerics, threads, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with Runtime.open(ck, RunOptions(budget=10**10, threads=threads, numerics=numerics)) as rt:
    ids = [(1 + 7919 * i) % rt.cfg.vocab_size for i in range(7)]
    for _ in rt.generate(rt.session(), ids, 20):
        pass
    step = []
    for _ in range(5):
        s = rt.session()
        tok = int(s.prefill(ids, last_only=True).argmax())
        c0 = time.process_time()
        for _ in range(steps // 5):
            tok = int(s.step(tok).argmax())
        step.append((time.process_time() - c0) / (steps // 5))
    pre = []
    for _ in range(10):
        s = rt.session()
        c0 = time.process_time()
        s.prefill(ids, last_only=True)
        pre.append(time.process_time() - c0)
    print(json.dumps({"step": min(step), "prefill": min(pre), "numerics": rt.stats().numerics}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numerics", default="fast")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tree", action="append", help="source tree first on the path (repeatable; default: this one)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds over the trees")
    a = ap.parse_args()
    from dsv4stream import synth
    from dsv4stream.measure.machine import machine_line

    trees = a.tree or [str(Path(__file__).resolve().parents[1])]
    with tempfile.TemporaryDirectory() as d:
        ck = Path(d) / "ck"
        synth.make_checkpoint(
            ck, preset="flash-experts", vocab_size=1024, hidden_size=256, moe_intermediate_size=256,
            q_lora_rank=128, o_lora_rank=128, tokenizer=False,
        )  # fmt: skip
        for r in range(a.rounds):
            for tree in trees:
                env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
                cmd = [sys.executable, "-c", CHILD, str(ck), a.numerics, str(a.threads), str(a.steps)]
                p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                if p.returncode:
                    sys.exit(f"step_overhead: the child for {tree} failed:\n{p.stderr[-2000:]}")
                rec = json.loads(p.stdout.strip().splitlines()[-1])
                print(
                    f"round {r + 1} {tree}: step {rec['step'] * 1e3:.2f} ms CPU, prefill of 7 {rec['prefill'] * 1e3:.2f}"
                    f" ms CPU (numerics {rec['numerics']}, threads {a.threads})",
                    flush=True,
                )
    print(f"# {machine_line()}")


if __name__ == "__main__":
    main()
