"""The trunk's one-token products one by one, from DRAM, at 1 and 2 threads (issue 44).

    python bench/trunk_products.py CHECKPOINT [--numerics fast] [--threads 1 2] [--gen 4] [--budget 3]

One Runtime (trunk resident), one warm-up generation, then per thread count the memory read
rate (`measure.readrate`, the method `bench/exact_structure.py --measure` divides by) right
before --gen timed tokens. Every one-token product of the decode steps (`kernels.matvec`,
`matmul`, `matmul_pair`, `matmul_grouped`; the routed experts' layer drivers are not counted) is
keyed by its weights' role, kind and shape; per key it prints calls per token, MB per token,
process CPU ms per token (every thread, the OpenMP worker's spinning included) and GB of weight
per process CPU second and per wall second, against the read rate: a product at the read rate
per CPU second on one thread, and per wall second on two, is memory-bound; a serial product at
2 threads shows half its 1-thread GB per CPU second (the worker spins beside it). The machine
line gives the CPU, its SIMD flags and the load.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from decode_floor import machine  # bench/ is on sys.path: the script's own folder

from dsv4stream.measure import readrate

GB = 1e9
_stats: dict[tuple, list[float]] = {}  # key -> [calls, bytes, process CPU s, wall s]


def _key(name: str, ws) -> tuple:
    w = ws[0]
    kind = f"{w.kind}x{len(ws)}" if len(ws) > 1 else w.kind
    rows = sum(v.rows for v in ws) if name == "matmul_grouped" else w.rows
    return (w.role, name, kind, f"{rows}x{w.cols}")


class _Timing:
    """The kernels' product provider with each one-token call timed by its weights' shape."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name not in ("matvec", "matmul", "matmul_pair", "matmul_grouped"):
            return attr

        def timed(*args):
            x = args[-1]
            if not (np.ndim(x) == 1 or np.shape(x)[0] == 1):
                return attr(*args)
            ws = list(args[0]) if isinstance(args[0], (list, tuple)) else list(args[:-1])
            c0, w0 = time.process_time(), time.perf_counter()
            y = attr(*args)
            c1, w1 = time.process_time(), time.perf_counter()
            s = _stats.setdefault(_key(name, ws), [0, 0, 0.0, 0.0])
            s[0] += 1
            s[1] += sum(w.nbytes for w in ws)
            s[2] += c1 - c0
            s[3] += w1 - w0
            return y

        return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--numerics", default="fast")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--gen", type=int, default=4)
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--prompt-ids", default="0,100,2000,30000")
    a = ap.parse_args()
    if a.gen < 2:  # the first token comes from the prompt's pass: --gen 1 times no decode step
        ap.error("--gen must be at least 2 (the first token is the prompt's; the steps after it are timed)")

    from dsv4stream import kernels
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime

    inner = kernels._products
    kernels._products = lambda: _Timing(inner())
    prompt = [int(v) for v in a.prompt_ids.split(",")]
    opts = RunOptions(budget=int(a.budget * GB), threads=max(a.threads), numerics=a.numerics, speculate="off")
    buf = readrate.buffer(None)
    print(machine(), flush=True)
    with Runtime.open(a.checkpoint, opts) as rt:
        kernels.set_threads(max(a.threads))
        list(rt.session().generate(prompt, a.gen))
        for t in a.threads:
            kernels.set_threads(t)
            rate = readrate.read_rate(t, buf)
            it = rt.session().generate(prompt, a.gen)
            next(it)  # the prefill stays out
            _stats.clear()
            c0, w0 = time.process_time(), time.perf_counter()
            steps = len(list(it))
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            load = ",".join(f"{v:.2f}" for v in os.getloadavg())
            print(
                f"\n{t} thread{'s' * (t > 1)}, numerics {a.numerics}, load {load}: read rate {rate.line()};"
                f" {steps} steps, {wall / steps * 1e3:.1f} ms, {cpu / steps * 1e3:.1f} process CPU ms each"
            )
            print(
                f"  {'role':6} {'call':14} {'kind':8} {'shape':12} {'n/tok':>5} {'MB/tok':>7} {'CPUms':>7} "
                f"{'GB/CPUs':>7} {'GB/s':>6}"
            )
            tot = {}
            for key in sorted(_stats, key=lambda k: -_stats[k][2]):
                n, b, c, w = _stats[key]
                role = key[0]
                agg = tot.setdefault(role, [0, 0.0, 0.0])
                agg[0] += b
                agg[1] += c
                agg[2] += w
                print(
                    f"  {key[0]:6} {key[1]:14} {key[2]:8} {key[3]:12} {n / steps:5.0f} {b / steps / 1e6:7.1f}"
                    f" {c / steps * 1e3:7.2f} {b / c / GB if c else 0:7.2f} {b / w / GB if w else 0:6.2f}"
                )
            for role, (b, c, w) in tot.items():
                print(
                    f"  total {role}: {b / steps / 1e6:.1f} MB/token, CPU {c / steps * 1e3:.1f} ms/token"
                    f" ({b / c / GB:.2f} GB per CPU s: CPU ratio {rate.cpu_gbps / (t * b / c / GB):.2f}),"
                    f" wall {w / steps * 1e3:.1f} ms ({b / w / GB:.2f} GB/s: ratio {rate.wall_gbps / (b / w / GB):.2f})"
                )
    del buf


if __name__ == "__main__":
    main()
