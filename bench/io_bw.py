"""Read bandwidth of the expert store's O_DIRECT path against `dd iflag=direct`, same file, same run.

The file holds N V4-Flash-sized experts laid out like the release: an odd-sized header, then
every expert's three E8M0 scale tensors (3 x 262,144 B, one run), then every expert's three FP4
weight tensors (3 x 4,194,304 B, another run, N x 0.79 MB further on), nothing 4096-aligned.
An expert is 13,369,344 bytes in two reads.

For each queue depth q, interleaved so that drive and host-cache state are shared:
  dd:    q `dd if=FILE of=/dev/null bs=13369344 iflag=direct` processes over disjoint
         ranges of the file; timed window = first start to last exit, N experts' bytes.
  store: ExpertStore(slots=2q, threads=q, io="direct"); timed window = first prefetch to the
         last release of all N experts in a seeded random order, keeping q reads in flight
         (prefetch q ahead, get, release; no compute). GB/s counts the experts' bytes.
Each pair is repeated (--repeat, interleaved); prints one line: per depth the median GB/s of
both (min-max), the store's busy-time GB/s and the ratio of medians, then the machine state.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dsv4stream.store import ExpertStore, Piece, merge_pieces

SCALES = (("w1.scale", (2048, 128)), ("w2.scale", (4096, 64)), ("w3.scale", (2048, 128)))
WEIGHTS = (("w1.weight", (2048, 2048)), ("w2.weight", (4096, 1024)), ("w3.weight", (2048, 2048)))
EXPERT = 13_369_344
HEADER = 8 + 1237


def build_file(path: Path, n: int) -> dict:
    """Write the file (unless already there at the right size); return the layouts."""
    located: dict[int, list] = {e: [] for e in range(n)}
    pos = HEADER
    for group in (SCALES, WEIGHTS):
        for e in range(n):
            for name, shape in group:
                nbytes = shape[0] * shape[1]
                located[e].append((str(path), Piece(f"experts.{e}.{name}", pos, nbytes, np.dtype(np.uint8), shape)))
                pos += nbytes
    if not path.exists() or path.stat().st_size != pos:
        block = np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8).tobytes()
        with open(path, "wb") as f:
            left = pos
            while left:
                left -= f.write(block[: min(left, len(block))])
            f.flush()
            os.fsync(f.fileno())
    return {e: merge_pieces(v) for e, v in located.items()}


def time_dd(path: Path, n: int, q: int) -> float:
    per = -(-n // q)
    t0 = time.perf_counter()
    cmd = ["dd", f"if={path}", "of=/dev/null", f"bs={EXPERT}", "iflag=direct", "status=none"]
    procs = [
        subprocess.Popen([*cmd, f"skip={i * per}", f"count={min(per, n - i * per)}"]) for i in range(q) if i * per < n
    ]
    if any(p.wait() for p in procs):
        sys.exit("io_bw: dd failed")
    return n * EXPERT / (time.perf_counter() - t0) / 1e9


def time_store(layouts: dict, q: int, seed: int) -> tuple[float, float, int]:
    order = list(layouts)
    random.Random(seed).shuffle(order)
    with ExpertStore(layouts, slots=2 * q, threads=q, io="direct") as store:
        t0 = time.perf_counter()
        for i, key in enumerate(order):
            store.prefetch(order[i + 1 : i + 1 + q])
            store.get(key)
            store.release(key)
        wall = time.perf_counter() - t0
        s = store.stats()
    return len(order) * EXPERT / wall / 1e9, s.read_gbps, s.fallback_files


def machine_state(path: Path) -> str:
    mounts = [ln.split() for ln in Path("/proc/mounts").read_text().splitlines()]
    best = max((m for m in mounts if str(path).startswith(m[1])), key=lambda m: len(m[1]))
    mem = {ln.split(":")[0]: ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()}
    load = os.getloadavg()
    return (
        f"fs={best[2]}:{best[0]} kernel={os.uname().release} cpus={os.cpu_count()} "
        f"load={load[0]:.2f} mem_avail={int(mem['MemAvailable']) / 2**20:.1f}GiB"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the test file goes (use the checkpoint's disk)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--depths", default="1,2,4,8")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved repeats; medians reported")
    ap.add_argument("--keep", action="store_true", help="keep the file for the next run")
    args = ap.parse_args()
    path = Path(args.dir) / f"dsv4-io-bw-{args.experts}.bin"
    layouts = build_file(path, args.experts)
    parts, fallback = [], 0
    try:
        for q in (int(x) for x in args.depths.split(",")):
            dd, wall, busy = [], [], []
            for r in range(args.repeat):
                dd.append(time_dd(path, args.experts, q))
                w, b, fb = time_store(layouts, q, seed=100 * q + r)
                wall.append(w)
                busy.append(b)
                fallback = max(fallback, fb)
            med = statistics.median
            parts.append(
                f"qd{q} store {med(wall):.2f} GB/s ({min(wall):.2f}-{max(wall):.2f}, busy {med(busy):.2f}) "
                f"dd {med(dd):.2f} ({min(dd):.2f}-{max(dd):.2f}) ratio {med(wall) / med(dd):.2f}"
            )
    finally:
        if not args.keep:
            path.unlink()
    io = "direct" if not fallback else "buffered-fallback"
    print(f"io_bw: {args.experts} experts x {EXPERT} B, io={io} | " + " | ".join(parts) + f" | {machine_state(path)}")


if __name__ == "__main__":
    main()
