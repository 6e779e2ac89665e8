"""Attention's two products at V4-Flash's dimensions: the numba kernels against numpy (BLAS).

Cases (random float32 inputs; 64 heads x 512, a window of 128 keys; the indexer's 64 heads x 128):
- decode: one query over the window plus 512 indexed compressed rows (a ratio-4 layer), over the
  window alone (a window-only layer), and the indexer's scores over 4,096 compressed rows (16k
  positions);
- prefill: a 64-query sub-chunk (the default `--chunk`) over the window and its own 64 keys (causal),
  with 512 indexed rows per query, over those keys alone, and the indexer over 4,096 rows.

Timed window of one case: one call of `kernels.attend` / `kernels.index_scores` with the fast
backend (the numba kernels, `kernels/attn.py`) and with the reference (numpy, whose matrix products
are OpenBLAS's sgemm: what attention ran before), inputs prepared outside; best of --repeat calls
after one untimed call. `--clock cpu` times process CPU seconds, so `--threads 1` gives the work
per core whatever else runs (run it with OPENBLAS_NUM_THREADS=1 for numpy too). Each line also
prints GFLOP/s (2 flops per multiply-add of the scores and the weighted sum, or of the index dots)
and the ratio to numpy float32 sgemm of the same multiply-adds on one (64 x 512) x (512 x rows)
product per query (the machine's own BLAS rate, measured in the same run).
Prints a header with the CPU, SIMD flags, load and threads, one line per case, and the load after.
"""

from __future__ import annotations

import argparse
import os
import time

# idle OpenBLAS workers spin after each call and would take the cores from the kernel timed next
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import numpy as np

from dsv4stream import kernels
from dsv4stream.kernels import reference
from dsv4stream.measure.machine import machine_line

CLOCK = [time.perf_counter]

H, HD, WINDOW, TOPK, IH, IHD, INDEX_ROWS = 64, 512, 128, 512, 64, 128, 4096


def best(fn, repeat: int, *args) -> float:
    clock = CLOCK[0]
    fn(*args)
    out = []
    for _ in range(repeat):
        t0 = clock()
        fn(*args)
        out.append(clock() - t0)
    return min(out)


def cases(rng):
    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    comp = r(4 * TOPK, HD)
    for phase, t in (("decode", 1), ("prefill", 64)):
        keys = r(WINDOW + t - 1, HD)
        mask = np.tril(np.ones((t, keys.shape[0]), bool), WINDOW - 1)
        idx = np.stack([np.sort(rng.permutation(comp.shape[0])[:TOPK]) for _ in range(t)])
        q, sink = r(t, H, HD), r(H)
        rows = int(mask.sum()) + t * TOPK
        yield phase, "window+512 indexed", (q, keys, mask, comp, None, idx, sink), "attend", 2 * rows * H * HD
        yield phase, "window only", (q, keys, mask, None, None, None, sink), "attend", 2 * int(mask.sum()) * H * HD
        qi, w, ik = r(t, IH, IHD), r(t, IH), r(INDEX_ROWS, IHD)
        yield phase, f"indexer {INDEX_ROWS} rows", (qi, w, ik), "index_scores", t * INDEX_ROWS * IH * IHD


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    if args.clock == "cpu":
        CLOCK[0] = time.process_time
    kernels.set_backend("fast")
    warm = kernels.warmup()
    kernels.set_threads(args.threads)
    from dsv4stream.kernels import attn, fast

    threads = fast.get_threads()
    print(
        f"# machine: {machine_line()} threads={threads} clock={args.clock} warmup_s={warm:.1f}"
        f" OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"
    )
    rng = np.random.default_rng(0)
    gemm_a, gemm_b = rng.standard_normal((H, HD)).astype(np.float32), rng.standard_normal((640, HD)).astype(np.float32)
    sgemm = 2 * H * HD * 640 / best(np.matmul, args.repeat * 3, gemm_a, gemm_b.T) / 1e9
    print(f"# numpy sgemm (64 x 512) x (512 x 640): {sgemm:.1f} GFLOP/s")
    for phase, name, inputs, fn, macs in cases(rng):
        ours = best(getattr(attn, fn), args.repeat, *inputs)
        blas = best(getattr(reference, fn), args.repeat, *inputs)
        gflops = 2 * macs / ours / 1e9
        print(
            f"phase={phase} case={name!r} numba_ms={ours * 1e3:.2f} numpy_ms={blas * 1e3:.2f}"
            f" speedup={blas / ours:.2f} numba_gflops={gflops:.1f} vs_sgemm={gflops / sgemm:.2f}"
        )
    print(f"# load_avg after: {','.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
