#!/usr/bin/env python3
"""Where a batched decode pass gains and loses: `step_many` of B sessions against B `step`s, in process.

    bench/batch_profile.py CHECKPOINT [--rows 4] [--passes 4] [--numerics fast] [--threads 1] [--budget 64]
                           [--prompts 16]

Opens the checkpoint as `dsv4 run` does (`Runtime.open`, --budget GB: the default holds every
expert in RAM), prefills B sessions with different short prompts, then feeds each its greedy
tokens for --passes passes, first one `step` per session ("solo"), then one `step_many` over
all of them ("batch"), twice each, alternating (fresh sessions each round, the same prompts, so
both ways compute the same tokens: checked). Timed window: the passes only (prefills outside).
With --prompts N the window holds the prompts too (N tokens each, cut as the server cuts them:
one token short of the prompt is a segment boundary): "solo" reads each prompt and steps its
tokens one request after another, as a server serves them one after another; "batch" reads the
prompts together, each segment of every prompt in one pass (`forward_many`), then steps them
together: the server's ratio for requests sent at once, without its HTTP side; "apart" reads the
prompts one after another and steps them together (the server before prompts were joined).
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
from dsv4stream.engine.batch import Feed, forward_many, step_many
from dsv4stream.engine.session import segment_cuts
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
    ap.add_argument("--prompts", type=int, default=0, help="prompt tokens each, read inside the window (0: outside)")
    a = ap.parse_args()
    opts = RunOptions(budget=int(a.budget * 1e9), ctx=1024, threads=a.threads, numerics=a.numerics)
    with Runtime.open(a.checkpoint, opts) as rt:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(2, 1000, a.prompts or 8 + k) for k in range(a.rows)]

        def fresh(mode: str = "solo", timed: bool = False):
            ss = [rt.session() for _ in prompts]
            if timed and mode == "batch":
                return ss, together(ss)
            return ss, [
                int(np.argmax(s.prefill(p, last_only=True, boundaries=[len(p) - 1])))
                for s, p in zip(ss, prompts, strict=True)
            ]

        def together(ss) -> list[int]:
            """The prompts read together, segment by segment, as the batching server reads them."""
            cuts = [segment_cuts(len(p), s.segment, [len(p) - 1]) for s, p in zip(ss, prompts, strict=True)]
            done, last = [0] * len(ss), [0] * len(ss)
            while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
                who = [k for k in range(len(ss)) if done[k] < len(prompts[k])]
                ends = [next(c for c in cuts[k] if c > done[k]) for k in who]
                feeds = [
                    Feed(ss[k], prompts[k][done[k] : b], "last" if b == len(prompts[k]) else "none")
                    for k, b in zip(who, ends, strict=True)
                ]
                for k, b, out in zip(who, ends, forward_many(feeds), strict=True):
                    done[k] = b
                    if out is not None:
                        last[k] = int(np.argmax(out))
            return last

        ss, toks = fresh()
        step_many(ss, toks)  # warm: kernels compiled, pages touched
        ids: dict[str, list] = {}
        print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        modes = ("solo", "apart", "batch") if a.prompts else ("solo", "batch")
        for mode in modes * 2:
            if not a.prompts:
                ss, toks = fresh()
            k0, t0, c0 = kernels.kernel_seconds(), time.perf_counter(), time.process_time()
            if a.prompts and mode != "solo":
                ss, toks = fresh(mode, timed=True)
            got = []
            if a.prompts and mode == "solo":  # each request whole, one after another
                ss = [rt.session() for _ in prompts]
                rows = []
                for s, p in zip(ss, prompts, strict=True):
                    t = [int(np.argmax(s.prefill(p, last_only=True, boundaries=[len(p) - 1])))]
                    for _ in range(a.passes):
                        t.append(int(np.argmax(s.step(t[-1]))))
                    rows.append(t)
                got = [list(r) for r in zip(*rows, strict=True)][1:]
            else:
                for _ in range(a.passes):
                    if mode == "solo":  # (prompts: "apart", the decode batched, the prompts one after another)
                        out = np.stack([s.step(t) for s, t in zip(ss, toks, strict=True)])
                    else:
                        out = step_many(ss, toks)
                    toks = [int(np.argmax(r)) for r in out]
                    got.append(toks)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            k1 = kernels.kernel_seconds()
            roles = {r: k1.get(r, 0.0) - k0.get(r, 0.0) for r in ("trunk", "experts", "head")}
            ids.setdefault(mode, got)
            n = a.rows * (a.passes + (1 if a.prompts else 0))  # with prompts: their first tokens too
            print(
                f"{mode}: {n} tokens in {wall:.2f} s = {n / wall:.2f} tok/s; kernel s "
                + ", ".join(f"{r} {v:.2f}" for r, v in roles.items())
                + f"; outside the kernels {wall - sum(roles.values()):.2f} s"
                + f"; CPU {cpu:.2f} s = {n / cpu:.2f} tok/s",
                flush=True,
            )
        print(f"same tokens every way: {all(v == ids['solo'] for v in ids.values())}", flush=True)


if __name__ == "__main__":
    main()
