"""The memory read rate a decode step's weight reads are judged against (issue 44's bound).

A weight-streaming kernel cannot read faster than DRAM delivers, so "compute within 1.3x of the
bytes at the read rate" needs the rate of the fastest possible reader, not of a convenient one:
- a buffer several times the last-level cache (read from sysfs: Emerald Rapids reports 300 MiB
  of L3), at least 1 GiB, so every pass comes from DRAM;
- written before timing (first touch: page faults and zeroing are not reads), one untimed pass;
- 64-byte vector loads (`<8 x i64>`, one `vmovdqa64` zmm on AVX-512, two ymm on AVX2) in LLVM IR,
  not a compiler's choice of loop: numba's own uint64 sum reduced every 64 bytes across lanes
  and read 4.5 GB/s where this loop reads 12 (one thread, same buffer);
- each thread reads `streams` interleaved sub-ranges of its share (1, 2, 4, 8: more loads in
  flight, as a kernel reading several weight rows a pass has), and the best is kept;
- best of `repeat` passes, per wall second and per CPU second (the process's CPU time over the
  threads: what the threads read while they run, whoever else shares the cores).
The sum is checked, so a pass that skipped memory would fail rather than report a rate.
`bench/exact_structure.py --measure` prints it beside likwid-bench's `load_avx512` where
installed (an independent reader); docs/performance.md says how the two compare.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

GB = 1e9
STREAMS = (1, 2, 4, 8)
_LINE = 8  # uint64 words per 64-byte load
_I32, _I64 = ir.IntType(32), ir.IntType(64)


def llc_bytes(cpu: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Size of the largest cache level sysfs lists (0 where it lists none)."""
    best = (0, 0)
    for d in cpu.glob("index*"):
        try:
            level = int((d / "level").read_text())
            text = (d / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        size = int(text.rstrip("KMG")) * unit
        best = max(best, (level, size))
    return best[1]


def buffer_bytes(llc: int) -> int:
    """4x the LLC, at least 1 GiB, a multiple of 64 MiB (every split below divides it)."""
    want = max(1 << 30, 4 * llc)
    return -(-want // (64 << 20)) * (64 << 20)


def _stream_sum(streams: int):
    """An intrinsic: the uint64 sum of `streams` runs of `lines` 64-byte lines starting at word
    `start` of a 1-d uint64 array, run s at start + s * lines * 8, read one line of each run
    per step into its own `<8 x i64>` accumulator."""

    @intrinsic
    def stream_sum(typingctx, a, start, lines):
        sig = types.uint64(a, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            arr = context.make_array(signature.args[0])(context, builder, args[0])
            base = builder.gep(builder.bitcast(arr.data, _I64.as_pointer()), [args[1]])
            vty = ir.VectorType(_I64, _LINE)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vty, [0] * _LINE)) for _ in range(streams)]
            lines = args[2]
            run = builder.mul(lines, ir.Constant(_I64, _LINE))
            with cgutils.for_range(builder, lines) as loop:
                at = builder.mul(loop.index, ir.Constant(_I64, _LINE))
                for s in range(streams):
                    off = builder.add(builder.mul(ir.Constant(_I64, s), run), at)
                    ptr = builder.bitcast(builder.gep(base, [off]), vty.as_pointer())
                    builder.store(builder.add(builder.load(accs[s]), builder.load(ptr, align=64)), accs[s])
            total = builder.load(accs[0])
            for acc in accs[1:]:
                total = builder.add(total, builder.load(acc))
            out = builder.extract_element(total, ir.Constant(_I32, 0))
            for k in range(1, _LINE):
                out = builder.add(out, builder.extract_element(total, ir.Constant(_I32, k)))
            return out

        return sig, codegen

    @njit(parallel=True)  # no cache: the intrinsic is made per stream count at import
    def read(a, parts):
        share = a.size // parts
        lines = share // (_LINE * streams)
        out = np.zeros(parts, np.uint64)
        for p in prange(parts):
            out[p] = stream_sum(a, p * share, lines)
        return out.sum()

    return read


_READERS = {s: _stream_sum(s) for s in STREAMS}


@dataclass(frozen=True)
class Rate:
    threads: int
    wall_gbps: float  # bytes per wall second, best pass
    cpu_gbps: float  # bytes per CPU second of one thread (process CPU time / threads), best pass
    streams: int  # per thread, of the best wall pass
    nbytes: int
    llc: int

    def line(self) -> str:
        return (
            f"{self.wall_gbps:.1f} GB/s per wall second, {self.cpu_gbps:.1f} per thread CPU second"
            f" ({self.threads} thread{'s' * (self.threads > 1)}, {self.streams} streams each)"
        )


def buffer(nbytes: int | None = None) -> np.ndarray:
    """The read buffer, every page written (first touch outside any timing); each word is 1."""
    n = buffer_bytes(llc_bytes()) if nbytes is None else nbytes
    return np.ones(n // 8, np.uint64)


def read_rate(threads: int, a: np.ndarray | None = None, repeat: int = 5, streams=STREAMS) -> Rate:
    """Best read rate of `a` (default `buffer()`) at `threads` numba threads over `streams`."""
    a = buffer() if a is None else a
    if a.size % (threads * max(streams) * _LINE):
        raise ValueError(f"read_rate: {a.nbytes} bytes do not split into {threads} x {max(streams)} lines")
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    best_wall, best_cpu, best_streams = 0.0, 0.0, streams[0]
    try:
        for s in streams:
            read = _READERS[s]
            if read(a, threads) != a.size:  # compiles (first call) and is the untimed pass
                raise RuntimeError("read_rate: the sum is wrong: the loop did not read every word")
            for _ in range(repeat):
                t0, c0 = time.perf_counter(), time.process_time()
                got = read(a, threads)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if got != a.size:
                    raise RuntimeError("read_rate: the sum is wrong: the loop did not read every word")
                if a.nbytes / wall > best_wall * GB:
                    best_wall, best_streams = a.nbytes / wall / GB, s
                best_cpu = max(best_cpu, a.nbytes / (max(cpu, 1e-9) / threads) / GB)
    finally:
        numba.set_num_threads(before)
    return Rate(threads, best_wall, best_cpu, best_streams, a.nbytes, llc_bytes())


def likwid_load(threads: int, nbytes: int, kernel: str = "load_avx512") -> float | None:
    """likwid-bench's `kernel` over `nbytes` at `threads` (MB/s / 1000 = GB/s per wall second),
    or None where likwid-bench is not installed or fails (Debian: `apt-get install likwid`)."""
    import shutil
    import subprocess

    exe = shutil.which("likwid-bench")
    if exe is None:
        return None
    cmd = [exe, "-t", kernel, "-W", f"N:{nbytes // (1 << 20)}MB:{threads}"]
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in p.stdout.splitlines():
        if line.startswith("MByte/s:"):
            return float(line.split()[1]) / 1e3
    return None


def load_text() -> str:
    return ",".join(f"{x:.2f}" for x in os.getloadavg())
