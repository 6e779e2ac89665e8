"""The fast numerics' kernels against the exact ones: GB/s of weight per CPU-second, and errors.

Products at V4-Flash's dimensions (`/work/shared/v4_flash_config.json`: hidden 4096, experts
2048 wide, q/o LoRA rank 1024, 64 heads of 512, vocab 129280), weights random in the release
formats (E8M0 scales): routed expert w1 2048x4096 and w2 4096x2048 (FP4), shared expert w1
2048x4096 and attention wo_b 4096x8192 (FP8, 128x128 blocks), the head 129280x4096 (BF16) as a
slice of 16384 rows. Each at T = 1, 2, 4, 8 tokens and a 64-token tile, `exact` then `fast`
through the public dispatch (`kernels.set_numerics`, `kernels.matmul`), plus the FP4 pair form
(`matmul_pair`: w1 and w3 of one expert) at one token.

Two residencies: "L2" multiplies one slice of the weight of about 1 MiB over and over (rows cut,
columns as in the model); "DRAM" cycles through copies of the whole weight totalling at least
--dram-mib, so each call reads its weight from memory. One thread, timed in process CPU seconds
(the machine is shared: a thread that waits for a core costs wall time, not CPU time), best of
--repeat windows of at least --seconds each. JIT compilation is done before timing.
Per line: gbps = weight bytes (data + scales) per call / CPU seconds per call, and the speed
ratio fast / exact. The error table: on heavy-tailed activations with outlier channels, each
mode's error against the float64 product with float32 activations, max and median over the
outputs, relative to each token's output RMS; `official` is V4's E4M3 / 128 grid.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import argparse
import time

import numpy as np

from dsv4stream import kernels
from dsv4stream.checkpoint import formats
from dsv4stream.kernels import QWeight, cpu, trunkq8
from dsv4stream.measure.machine import cpu_description

CASES = [  # name, kind, rows, cols
    ("expert.w1", "fp4", 2048, 4096),
    ("expert.w2", "fp4", 4096, 2048),
    ("shared.w1", "fp8", 2048, 4096),
    ("attn.wo_b", "fp8", 4096, 8192),
    ("head", "bf16", 16384, 4096),
]
TOKENS = (1, 2, 4, 8, 64)
L2_BYTES = 1 << 20


def activations(rng, t: int, c: int) -> np.ndarray:
    """Heavy-tailed tokens (Student t, 3 dof), per-channel spread, 1/64 outlier channels x10-50."""
    x = rng.standard_t(3, (t, c)).astype(np.float32)
    ch = rng.choice(c, c // 64, replace=False)
    x[:, ch] *= rng.uniform(10, 50, ch.size).astype(np.float32)
    return x * np.exp(rng.normal(0, 1, c)).astype(np.float32)


def make_weight(rng, kind: str, r: int, c: int) -> QWeight:
    wf = (rng.standard_normal((r, c)) * 0.02).astype(np.float32)
    if kind == "fp4":
        d, s = formats.quantize_fp4(wf)
        return QWeight("fp4", d, s, r, c, role="experts")
    if kind == "fp8":
        d, s = formats.quantize_fp8(wf)
        return QWeight("fp8", d, s, r, c)
    return QWeight("bf16", formats.f32_to_bf16(wf), None, r, c, role="head")


def rows_for(kind: str, c: int, nbytes: int) -> int:
    per_row = {"fp4": c // 2 + c // 32, "fp8": c, "bf16": 2 * c}[kind]
    return max(128, nbytes // per_row // 128 * 128)


def cpu_time_per_call(fn, seconds: float, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        n, t0 = 0, time.process_time()
        while True:
            fn(n)
            n += 1
            spent = time.process_time() - t0
            if spent >= seconds and n >= 3:
                break
        best = min(best, spent / n)
    return best


def speed(args, rng) -> None:
    for name, kind, r, c in CASES:
        for where in ("L2", "DRAM"):
            rows = min(r, rows_for(kind, c, L2_BYTES)) if where == "L2" else r
            w0 = make_weight(rng, kind, rows, c)
            copies = 1 if where == "L2" else max(2, -(-args.dram_mib * (1 << 20) // w0.nbytes))
            ws = [w0] + [
                QWeight(w0.kind, w0.data.copy(), None if w0.scale is None else w0.scale.copy(), rows, c, w0.role)
                for _ in range(copies - 1)
            ]
            for t in TOKENS:
                x = activations(rng, t, c)
                got = {}
                for mode in ("exact", "fast"):
                    kernels.set_numerics(mode)
                    kernels.matmul(w0, x)  # compile outside the window
                    sec = cpu_time_per_call(
                        lambda i, ws=ws, x=x, n=copies: kernels.matmul(ws[i % n], x), args.seconds, args.repeat
                    )
                    got[mode] = w0.nbytes / sec / 1e9
                print(
                    f"{name:10s} {kind:4s} {rows:6d}x{c:<5d} {where:4s} T={t:<3d} exact {got['exact']:7.2f}  fast {got['fast']:7.2f} GB/s/CPU-s  x{got['fast'] / got['exact']:.2f}",
                    flush=True,
                )
        if kind == "fp4":
            rows = min(r, rows_for(kind, c, L2_BYTES))
            w1, w3 = make_weight(rng, kind, rows, c), make_weight(rng, kind, rows, c)
            x = activations(rng, 1, c)
            got = {}
            for mode in ("exact", "fast"):
                kernels.set_numerics(mode)
                kernels.matmul_pair(w1, w3, x)
                sec = cpu_time_per_call(
                    lambda i, w1=w1, w3=w3, x=x: kernels.matmul_pair(w1, w3, x), args.seconds, args.repeat
                )
                got[mode] = 2 * w1.nbytes / sec / 1e9
            print(
                f"{name:10s} pair {rows:6d}x{c:<5d} L2   T=1   exact {got['exact']:7.2f}  fast {got['fast']:7.2f} GB/s/CPU-s  x{got['fast'] / got['exact']:.2f}",
                flush=True,
            )
    kernels.set_numerics("exact")


def dense64(w: QWeight) -> np.ndarray:
    if w.kind == "fp4":
        return formats.dequant_fp4(w.data, w.scale).astype(np.float64)
    if w.kind == "fp8":
        return formats.dequant_fp8(w.data, w.scale, w.block).astype(np.float64)
    return formats.bf16_to_f32(w.data).astype(np.float64)


def errors(rng) -> None:
    print("error vs float64 product of float32 activations, relative to the output RMS (max / median):")
    for name, kind, r, c in CASES:
        w = make_weight(rng, kind, min(r, 512), c)
        x = activations(rng, 16, c)
        ref = x.astype(np.float64) @ dense64(w).T
        rms = np.sqrt((ref**2).mean(axis=1, keepdims=True))
        cells = []
        for mode in ("exact", "official", "fast"):
            kernels.set_numerics(mode)
            e = np.abs(kernels.matmul(w, x) - ref) / rms
            cells.append(f"{mode} {100 * e.max():.3f}% / {100 * np.median(e):.4f}%")
        if kind == "fp8" and trunkq8.possible():  # fast's opt-in int8 trunk (DSV4_INT8_TRUNK=1)
            e = np.abs(trunkq8.matmul(trunkq8.quantize(w), x) - ref) / rms
            cells.append(f"int8 trunk {100 * e.max():.3f}% / {100 * np.median(e):.4f}%")
        print(f"  {name:10s} {kind:4s} " + "  ".join(cells), flush=True)
    kernels.set_numerics("exact")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=0.3, help="CPU seconds per timed window")
    p.add_argument("--repeat", type=int, default=3, help="windows per measurement (best counts)")
    p.add_argument("--dram-mib", type=int, default=256, help="total size of the weight copies cycled from memory")
    p.add_argument("--errors-only", action="store_true")
    args = p.parse_args()
    kernels.set_threads(1)
    rng = np.random.default_rng(0)
    print(
        f"# {cpu_description()} | {cpu.describe()} | load {os.getloadavg()[0]:.2f} | 1 thread, CPU seconds", flush=True
    )
    errors(rng)
    if not args.errors_only:
        speed(args, rng)
    print(f"# load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
