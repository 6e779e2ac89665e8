"""The one-token FP8 x BF16 kernel with and without the next pass's prefetch, from DRAM, one process.

    python bench/row_prefetch.py [--shapes 32768x1024,4096x2048,4096x8192] [--threads 1] [--gb 1.2] [--reps 5]
        [--forms 4:1:3,4:0:3]

Builds `kernels.bf16`'s FP8 driver once per form ROWS:PASSES:LOCALITY (uncached: they differ only
in the one-token pass kernel: ROWS rows a pass, dividing `bf16.ROWS`; prefetching the same columns
PASSES passes ahead, 0 for none; `llvm.prefetch` locality 3 = L1 .. 1 = L3), checks that all give
the same bits, then per shape cycles through copies of a random E4M3 weight adding up to --gb
(several times the LLC, so every pass reads DRAM) and prints the best GB of weight per
thread-CPU-second of each, alternating (a load change hits all). Issue 44: rows of 1-2 KB read at
about half the rate of 8 KB rows without the prefetch. On an AVX2 target the one-token kernel
is compute-bound (docs/performance.md, trunk44f): the forms matter where it is not.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numba
import numpy as np

from dsv4stream.kernels import bf16, cpu


def drivers(variant: str, forms: list[str]) -> dict[str, object]:
    out = {}
    bf16._JIT["cache"] = False  # builds of one function name: numba's cache would mix them
    try:
        for form in forms:
            nr, passes, locality = (int(v) for v in form.split(":"))
            out[form] = bf16._driver("fp8", variant, nr=nr, prefetch=passes, locality=locality)
    finally:
        bf16._JIT["cache"] = True
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32768x1024,4096x2048,4096x8192")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gb", type=float, default=1.2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--forms", default="4:1:3,4:0:3", help="ROWS:PASSES:LOCALITY, the first the reference")
    a = ap.parse_args()
    variant = cpu.variant("fp8")
    if variant is None:
        raise SystemExit("row_prefetch: no fast FP8 kernel for this CPU target")
    numba.set_num_threads(a.threads)
    ds = drivers(variant, a.forms.split(","))
    first = next(iter(ds))
    rng = np.random.default_rng(0)
    for shape in a.shapes.split(","):
        R, C = (int(v) for v in shape.split("x"))
        n = max(2, int(a.gb * 1e9 // (R * C)))
        ws = []
        for _ in range(n):
            w = rng.integers(0, 0x7E, (R, C), dtype=np.uint8) | (rng.integers(0, 2, (R, C), dtype=np.uint8) << 7)
            ws.append((w, np.full((-(-R // 128), -(-C // 128)), 127, np.uint8)))
        x = rng.standard_normal((1, 1, C)).astype(np.float32)
        outs = {k: np.empty((1, R), np.float32) for k in ds}
        for k, d in ds.items():
            d(ws[0][0], ws[0][1], 128, 128, x, R, outs[k])
        for k in ds:
            if not np.array_equal(outs[first].view(np.uint32), outs[k].view(np.uint32)):
                raise SystemExit(f"row_prefetch: forms {first} and {k} differ on {shape}")
        best = dict.fromkeys(ds, 0.0)
        for _ in range(a.reps):
            for k, d in ds.items():
                c0 = time.process_time()
                for w, s in ws:
                    d(w, s, 128, 128, x, R, outs[k])
                best[k] = max(best[k], n * R * C / ((time.process_time() - c0) / a.threads) / 1e9)
        print(
            f"{shape} x{n} ({variant}, {a.threads} thread(s), load {os.getloadavg()[0]:.1f}): GB per thread-CPU-second "
            + ", ".join(f"{k} {v:.2f} ({v / best[first]:.2f}x)" for k, v in best.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
