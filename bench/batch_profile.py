#!/usr/bin/env python3
"""Where a batched decode pass gains and loses: `step_many` of B sessions against B `step`s, in process.

    bench/batch_profile.py CHECKPOINT [--rows 4] [--passes 4] [--numerics fast] [--threads 1] [--budget 64]

Opens the checkpoint as `dsv4 run` does (`Runtime.open`, --budget GB: the default holds every
expert in RAM), prefills B sessions with different short prompts, then feeds each its greedy
tokens for --passes passes, first one `step` per session ("solo"), then one `step_many` over
all of them ("batch"), twice each, alternating (fresh sessions each round, the same prompts, so
both ways compute the same tokens: checked). Timed window: the passes only (prefills outside).
Prints per round: tokens/s both ways and the kernel seconds by weight role (trunk, experts,
head: `kernels.kernel_seconds()`), the wall time outside the kernels (Python, attention's
own loops, routing), and the process's CPU seconds (`time.process_time`, every thread), whose
ratio a busy machine disturbs much less than the wall's. Give the load (`uptime`) with the
figures: only ratios within a run mean something on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from dsv4stream import kernels
from dsv4stream.engine.batch import step_many
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--numerics", default="fast")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", type=float, default=64.0, help="GB (default: every expert in RAM)")
    a = ap.parse_args()
    opts = RunOptions(budget=int(a.budget * 1e9), ctx=1024, threads=a.threads, numerics=a.numerics)
    with Runtime.open(a.checkpoint, opts) as rt:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(2, 1000, 8 + k) for k in range(a.rows)]

        def fresh():
            ss = [rt.session() for _ in prompts]
            return ss, [int(np.argmax(s.prefill(p, last_only=True))) for s, p in zip(ss, prompts, strict=True)]

        ss, toks = fresh()
        step_many(ss, toks)  # warm: kernels compiled, pages touched
        ids: dict[str, list] = {}
        print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        for mode in ("solo", "batch", "solo", "batch"):
            ss, toks = fresh()
            k0, t0, c0 = kernels.kernel_seconds(), time.perf_counter(), time.process_time()
            got = []
            for _ in range(a.passes):
                if mode == "solo":
                    out = np.stack([s.step(t) for s, t in zip(ss, toks, strict=True)])
                else:
                    out = step_many(ss, toks)
                toks = [int(np.argmax(r)) for r in out]
                got.append(toks)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            k1 = kernels.kernel_seconds()
            roles = {r: k1.get(r, 0.0) - k0.get(r, 0.0) for r in ("trunk", "experts", "head")}
            ids.setdefault(mode, got)
            n = a.rows * a.passes
            print(
                f"{mode}: {n} tokens in {wall:.2f} s = {n / wall:.2f} tok/s; kernel s "
                + ", ".join(f"{r} {v:.2f}" for r, v in roles.items())
                + f"; outside the kernels {wall - sum(roles.values()):.2f} s"
                + f"; CPU {cpu:.2f} s = {n / cpu:.2f} tok/s",
                flush=True,
            )
        print(f"same tokens both ways: {ids['solo'] == ids['batch']}", flush=True)


if __name__ == "__main__":
    main()
