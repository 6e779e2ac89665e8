"""Quantized matmul kernels on V4-Flash shapes against this machine's memory read bandwidth and BLAS.

`--family v41`: the same cases on V4.1-Flash shapes (hidden 5120, experts 2304 wide), FP8 with 32x32 scale
blocks, and the timed window of an FP8 / FP4 case holds V4.1's activation grid too
(`model.v41.quant.act_qdq(X)`, then the product: what a V4.1 linear costs). `--vs-v4` times each of
them again in V4's form in the same run (the same shape; FP8 with 128x128 blocks; no activation
grid), windows interleaved, and adds v4_ms and speed_vs_v4 = v4_ms / ms (1.0: V4.1 as fast as V4).

Cases (random weights in the release formats, E8M0 scales): routed expert w1 2048x4096 and w2
4096x2048 (FP4); attention wq_b 32768x1024 and wo_b 4096x8192, shared-expert w1 2048x4096 (FP8);
head 129280x4096 (BF16); each at 1 token and at 16, 48, 96, 192 and 384 tokens (what prefill
gives one expert: segment S x 6 / n_experts, S = 1024 / 256 experts -> 24, S = 4096 / 64 experts
-> 384; the trunk sees the whole segment).

Measured in the same run, before the cases:
  mem_read_gbps: the best of 3 passes of `np.add.reduce` over a 1 GiB uint64 array, by one
  thread and by `threads` threads on disjoint slices (numpy releases the GIL); the larger wins.

Timed window of one case: n consecutive calls of `kernels.matmul(W_i, X)` through the public
dispatch (fast backend): input reordering, output allocation and the kernel, nothing else.
W_i cycles through copies of the weight whose total is at least 256 MiB (8x the L3 of this
machine class), so the weights stream from DRAM as they do from expert slots; X (float32
(T, cols), N(0,1)) stays cached. n covers every copy at least once and at least --seconds;
the window is repeated --repeat times and `ms` is the best window's time per call (the
machine is shared: the best window is the one least disturbed; BLAS is timed the same way).
JIT compilation is excluded (`warmup()` first; its time is in the header).

Per case: gbps = weight bytes (data + scales) per call / time; gflops = 2*R*C*T / time;
ratio = gbps / mem_read_gbps. Multi-token cases add vs_blas = our GFLOP/s over numpy float32
GEMM `X @ W.T` (OpenBLAS, all cores) on the same shape, weight resident (best of repeats).
OPENBLAS_THREAD_TIMEOUT=4 (unless set) keeps idle OpenBLAS workers from spinning into our timing.
`--clock cpu` times both sides in process CPU seconds instead of wall seconds: on a shared
machine a thread that waits for a core costs wall time but no CPU time, so with `--threads 1`
and OPENBLAS_NUM_THREADS=1 the vs_blas ratio is the two kernels' work per core whatever the
load (gbps and ratio are then per CPU-second, not what the machine delivers).
Prints a header line with the machine state (CPU model, SIMD features, load), one line per
case, and a footer with the load at the end (other users of the machine show up there).
"""

from __future__ import annotations

import os

# OpenBLAS workers spin long after each call and would take the cores from the kernels timed
# next (0.31 -> 6.6 ms for an FP4 matvec after a small sgemm); read when numpy loads.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import argparse
import math
import time
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from dsv4stream import kernels
from dsv4stream.kernels import QWeight
from dsv4stream.measure.machine import cpu_description

CASES = (
    ("expert.w1", "fp4", 2048, 4096),
    ("expert.w2", "fp4", 4096, 2048),
    ("attn.wq_b", "fp8", 32768, 1024),
    ("attn.wo_b", "fp8", 4096, 8192),
    ("shared.w1", "fp8", 2048, 4096),
    ("head", "bf16", 129280, 4096),
)
# V4.1-Flash (--family v41): hidden 5120, experts 2304 wide, FP8 scales per 32x32 block
CASES_V41 = (
    ("expert.w1", "fp4", 2304, 5120),
    ("expert.w2", "fp4", 5120, 2304),
    ("attn.wq_b", "fp8", 32768, 1280),
    ("attn.wo_b", "fp8", 5120, 8192),
    ("shared.w1", "fp8", 2304, 5120),
    ("head", "bf16", 129280, 5120),
)
FP8_BLOCK = {"v4": (128, 128), "v41": (32, 32)}
WORKING_SET = 256 << 20


def read_bandwidth(threads: int) -> tuple[float, float]:
    """GB/s of summing 1 GiB of uint64 with one thread and with `threads` threads."""
    a = np.ones(1 << 27, np.uint64)
    a.sum()  # fault the pages in before timing

    def best(parts: list[np.ndarray], pool: ThreadPoolExecutor) -> float:
        out = []
        for _ in range(3):
            t0 = time.perf_counter()
            list(pool.map(np.add.reduce, parts))
            out.append(a.nbytes / (time.perf_counter() - t0) / 1e9)
        return max(out)

    with ThreadPoolExecutor(threads) as pool:
        one = best([a], pool)
        many = best(np.array_split(a, threads), pool)
    return one, many


def make_weight(
    kind: str, rows: int, cols: int, rng: np.random.Generator, block: tuple[int, int] = (128, 128)
) -> QWeight:
    if kind == "fp4":
        data = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        scale = rng.integers(118, 128, (rows, cols // 32), dtype=np.uint8)
    elif kind == "fp8":
        # codes of Gaussian weights scaled as a release quantises them (largest |w| of a block near
        # 448): E4M3 subnormals are rare (~0.01 % of bytes), as in real weights; uniform bytes
        # would be 5 % subnormal, which the vector decode sends down its slow path
        z = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(448 / 4.5)
        data = np.clip(z, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        scale = rng.integers(118, 128, (math.ceil(rows / block[0]), math.ceil(cols / block[1])), dtype=np.uint8)
    else:  # bf16 with exponents 2^-7 .. 2^0 (no subnormals)
        data = (rng.integers(0, 1 << 16, (rows, cols), dtype=np.uint16) & 0x83FF) | 0x3C00
        scale = None
    return QWeight(kind, data, scale, rows, cols, block=block)


def copies(w: QWeight) -> list[QWeight]:
    n = max(1, math.ceil(WORKING_SET / w.nbytes))
    out = [w]
    for _ in range(n - 1):
        scale = None if w.scale is None else w.scale.copy()
        out.append(QWeight(w.kind, w.data.copy(), scale, w.rows, w.cols, block=w.block))
    return out


CLOCK = [time.perf_counter]  # or time.process_time (--clock cpu)


def _plain_call(w: QWeight, x: np.ndarray) -> None:
    kernels.matmul(w, x)


def _v41_call(w: QWeight, x: np.ndarray) -> None:
    from dsv4stream.model.v41.quant import act_qdq

    kernels.matmul(w, act_qdq(x) if w.kind in ("fp8", "fp4") else x)


def time_windows(sides, x: np.ndarray, seconds: float, repeat: int) -> list[list[float]]:
    """Per side (weight copies, call): seconds per call of each of `repeat` windows, the sides'
    windows interleaved (a load change on the shared machine hits both)."""
    clock = CLOCK[0]
    for ws, call in sides:
        call(ws[0], x)
    per_call: list[list[float]] = [[] for _ in sides]
    for _ in range(repeat):
        for i, (ws, call) in enumerate(sides):
            n = 0
            t0 = clock()
            while n < len(ws) or clock() - t0 < seconds:
                call(ws[n % len(ws)], x)
                n += 1
            per_call[i].append((clock() - t0) / n)
    return per_call


def time_blas(rows: int, cols: int, x: np.ndarray, repeat: int) -> float:
    """Best seconds per call of numpy float32 GEMM on the same shape."""
    clock = CLOCK[0]
    wf = np.full((rows, cols), 0.01, np.float32)
    x @ wf.T
    best = math.inf
    for _ in range(repeat):
        n = 0
        t0 = clock()
        while n < 2 or clock() - t0 < 0.3:
            x @ wf.T
            n += 1
        best = min(best, (clock() - t0) / n)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 48, 96, 192, 384])
    ap.add_argument("--cases", nargs="+", default=[c[0] for c in CASES], help="subset of case names")
    ap.add_argument("--family", choices=("v4", "v41"), default="v4", help="v41: V4.1-Flash shapes, 32x32 FP8 blocks")
    ap.add_argument("--seconds", type=float, default=0.3, help="minimum length of one timed window")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--vs-v4", action="store_true", help="v41: time each case in V4's form too (same run)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: process CPU seconds")
    args = ap.parse_args()
    if args.clock == "cpu":
        CLOCK[0] = time.process_time

    kernels.set_backend("fast")
    warm = kernels.warmup()
    kernels.set_threads(args.threads)
    threads = kernels.get_threads()
    one, many = read_bandwidth(threads)
    mem = max(one, many)
    load = os.getloadavg()
    print(
        f"# machine: {cpu_description()} cores={os.cpu_count()} threads={threads}"
        f" load_avg={load[0]:.2f},{load[1]:.2f},{load[2]:.2f} mem_read_gbps={mem:.1f}"
        f" (1 thread {one:.1f}, {threads} threads {many:.1f}) backend={kernels.backend_name()}"
        f" warmup_s={warm:.2f} numpy={np.__version__} clock={args.clock} family={args.family}"
        f" OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"
    )
    rng = np.random.default_rng(0)
    block = FP8_BLOCK[args.family]
    for name, kind, rows, cols in CASES_V41 if args.family == "v41" else CASES:
        if name not in args.cases:
            continue
        ws = copies(make_weight(kind, rows, cols, rng, block))
        v41 = args.family == "v41"
        v4 = copies(make_weight(kind, rows, cols, rng, FP8_BLOCK["v4"])) if v41 and args.vs_v4 else None
        for t in args.tokens:
            x = rng.standard_normal((t, cols)).astype(np.float32)
            sides = [(ws, _v41_call if v41 else _plain_call)] + ([(v4, _plain_call)] if v4 else [])
            got = time_windows(sides, x, args.seconds, args.repeat)
            sec = min(got[0])
            gbps = ws[0].nbytes / sec / 1e9
            gflops = 2 * rows * cols * t / sec / 1e9
            line = (
                f"name={name} dtype={kind} rows={rows} cols={cols} tokens={t} ms={sec * 1e3:.3f}"
                f" gbps={gbps:.2f} gflops={gflops:.1f} mem_read_gbps={mem:.1f} ratio={gbps / mem:.3f}"
            )
            if v4:
                line += f" v4_ms={min(got[1]) * 1e3:.3f} speed_vs_v4={min(got[1]) / sec:.2f}"
            if t > 1:
                blas = 2 * rows * cols * t / time_blas(rows, cols, x, args.repeat) / 1e9
                line += f" vs_blas={gflops / blas:.2f} blas_gflops={blas:.1f}"
            print(line, flush=True)
        del ws, v4
    load = os.getloadavg()
    print(f"# end: load_avg={load[0]:.2f},{load[1]:.2f},{load[2]:.2f}")


if __name__ == "__main__":
    main()
