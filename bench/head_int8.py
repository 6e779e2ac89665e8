"""The head alone, BF16 against its int8 copy, in one process: ms per token (wall and CPU).

    python bench/head_int8.py CHECKPOINT --trunk PACK [--threads 1 2] [--reps 15]

Loads the packed head (BF16, the product `fast` runs without the copy: `kernels.matmul` under
fast numerics, BF16 activations by `vdpbf16ps`) and the pack's int8 copy (`head-q8.bin`), then
alternates the two products on the same normed-like input (one token), each thread count in turn
inside every repetition, so a change of load hits both. Prints the median wall and process-CPU
ms per call, the GB/s of weight per wall second, the ratio int8 / BF16, and the load before and
after. Also the error of each against the float64 product (max|d| / max|ref| for that token).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from dsv4stream import kernels
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.kernels import headq8
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--trunk", required=True)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    print(f"# load before {os.getloadavg()}")
    cfg = Catalog.open(a.checkpoint).config
    opts = RunOptions(budget=int(40e9), trunk=a.trunk, numerics="fast", threads=max(a.threads))
    with Runtime.open(a.checkpoint, opts) as rt:  # the head as a fast run holds it, both forms
        top = rt.trunk.head()
        if top.q8 is None:
            raise SystemExit("this pack has no int8 head copy: run `dsv4 upgrade-trunk PACK` first")
        kernels.set_numerics("fast")
        x = np.random.default_rng(0).standard_normal((1, cfg.hidden_size)).astype(np.float32)
        prods = {
            "bf16": (lambda: kernels.matmul(top.head, x), top.head.nbytes),
            "int8": (lambda: headq8.matmul(top.q8.q, top.q8.s, x), top.q8.nbytes),
        }
        ref = x.astype(np.float64) @ kernels.dense(top.head).astype(np.float64).T
        for name, (f, _) in prods.items():
            y = f()
            print(f"# {name}: max|d|/max|ref| = {np.abs(y - ref).max() / np.abs(ref).max():.4f}")
        times: dict[tuple, list] = {(t, n): [] for t in a.threads for n in prods}
        for _ in range(a.reps):
            for t in a.threads:
                kernels.set_threads(t)
                for name, (f, _) in prods.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    f()
                    times[(t, name)].append((time.perf_counter() - t0, time.process_time() - c0))
        for t in a.threads:
            med = {}
            for name, (_, nbytes) in prods.items():
                wall = statistics.median(w for w, _ in times[(t, name)])
                cpu = statistics.median(c for _, c in times[(t, name)])
                med[name] = wall
                print(
                    f"threads={t} {name}: {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU,"
                    f" {nbytes / 1e9:.3f} GB, {nbytes / wall / 1e9:.1f} GB/s"
                )
            print(f"threads={t} int8/bf16 wall = {med['int8'] / med['bf16']:.2f}")
    print(f"# load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
