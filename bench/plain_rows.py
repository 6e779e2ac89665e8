"""The exact float32 / BF16 matvec row by row against MV_ROWS rows per pass, from DRAM, one process.

    python bench/plain_rows.py [--shapes 24x16384,4x16384,256x4096] [--kinds f32,bf16] [--gb 0.6] [--rounds 8]

Issue 44: the mHC's float32 24 x 16384 product (twice a layer, the exact kernel in every
numerics) read 3.7-4.8 GB per CPU second. Both kernels serial on this thread (the trunk runs
products under 4 MiB so), bits checked equal, then per shape copies of a random weight adding up
to --gb (beyond the LLC) cycled, rounds alternating the two kernels: the best GB of weight per
thread-CPU second of each. The old row-by-row loop is rebuilt here from `plain._plain_row`.
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
from numba import carray, njit

from dsv4stream.kernels import plain
from dsv4stream.kernels.jit import _stack_f32

LANES = plain.LANES


@njit(cache=False)
def row_by_row(w, x, rpg, out):
    acc = carray(_stack_f32(LANES), (LANES,))
    for r in range(w.shape[0]):
        out[r] = plain._plain_row(w, r, x[r // rpg], acc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="24x16384,4x16384,256x4096")
    ap.add_argument("--kinds", default="f32,bf16")
    ap.add_argument("--gb", type=float, default=0.6)
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"load {','.join(f'{v:.2f}' for v in os.getloadavg())}")
    kernels = {"row by row": row_by_row, f"{plain.MV_ROWS} rows a pass": plain._plain_mv_serial}
    for kind in a.kinds.split(","):
        for shape in a.shapes.split(","):
            R, C = (int(v) for v in shape.split("x"))

            def make(R=R, C=C, kind=kind):
                w = rng.standard_normal((R, C), dtype=np.float32)
                return w if kind == "f32" else (w.view(np.uint32) >> 16).astype(np.uint16)

            x = rng.standard_normal((1, C), dtype=np.float32)
            ws = [make() for _ in range(max(2, int(a.gb * 1e9 // (R * C * (4 if kind == "f32" else 2)))))]
            outs = {}
            for name, k in kernels.items():
                outs[name] = np.empty(R, np.float32)
                k(ws[0], x, R, outs[name])
            a0, a1 = outs.values()
            same = np.array_equal(a0.view(np.uint32), a1.view(np.uint32))
            best = dict.fromkeys(kernels, 0.0)
            out = np.empty(R, np.float32)
            for _ in range(a.rounds):
                for name, k in kernels.items():
                    c0 = time.thread_time()
                    for w in ws:
                        k(w, x, R, out)
                    best[name] = max(best[name], sum(w.nbytes for w in ws) / (time.thread_time() - c0) / 1e9)
            rates = ", ".join(f"{n} {g:.2f}" for n, g in best.items())
            print(f"{kind} {shape}: bits equal {same}; GB per CPU second (best of {a.rounds}): {rates}", flush=True)
    print(f"load {','.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
