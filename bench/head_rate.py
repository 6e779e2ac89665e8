"""The int8 head product alone against the memory read rate, in one process (issue 44).

    python bench/head_rate.py PACK_DIR [--threads 1 2] [--reps 9] [--tokens 1] [--compare]

Reads the pack's int8 head copy (`head-q8.bin`, xxh3-checked) into RAM and times
`headq8.matmul` on one normed-like token (rows x cols int8 + row scales; the activation's
quantization and the output allocation inside the timed window, as a decode step has them),
alternating with `measure/readrate.py`'s read rate at each thread count inside every repetition,
so a load change hits both. Prints per thread count the median wall and process-CPU ms per call,
GB of weight per wall second and per thread-CPU second, and the ratio of the product's time to
the head's bytes at the read rate measured in the same repetitions (1.00 = at the read rate),
per wall second and per thread-CPU second (the figure to quote under load).
--compare REV also times the head kernel of git revision REV (its `kernels/headq8.py` loaded
beside this one, numba's cache off for it) and checks that its bits equal this tree's. Prints the CPU, numba's SIMD variant, the threading
layer and the load before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np

from dsv4stream.kernels import cpu, headq8
from dsv4stream.measure import readrate
from dsv4stream.trunkpack import headcopy

GB = 1e9


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def module_at(rev: str):
    """`dsv4stream/kernels/headq8.py` as of git revision `rev`, imported as a sibling module
    (its relative imports resolve in this tree's package), numba's on-disk cache off."""
    import importlib.util
    import subprocess
    import tempfile

    repo = Path(__file__).resolve().parents[1]
    src = subprocess.run(
        ["git", "-C", str(repo), "show", f"{rev}:dsv4stream/kernels/headq8.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.replace('"cache": True', '"cache": False')
    path = Path(tempfile.mkdtemp()) / "headq8_at.py"
    path.write_text(src)
    name = "dsv4stream.kernels._headq8_at"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pack", help="packed trunk folder holding head-q8.bin (e.g. CHECKPOINT/dsv4-trunk)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--compare", metavar="REV", help="also time REV's headq8 (git revision; same bits checked)")
    a = ap.parse_args()
    root = Path(a.pack)
    entry = json.loads((root / "manifest.json").read_text()).get(headcopy.ENTRY)
    if entry is None:
        raise SystemExit(f"{root}: no int8 head copy in this pack (run `dsv4 upgrade-trunk {root}`)")
    q, s = headcopy.read_copy(root, entry)
    nbytes = q.nbytes + s.nbytes
    x = np.random.default_rng(0).standard_normal((a.tokens, q.shape[1])).astype(np.float32)
    name, _ = cpu.target()
    print(
        f"# cpu={cpu_name()!r} numba_target={name} variant={headq8.variant()}"
        f" head={q.shape[0]}x{q.shape[1]} int8 ({nbytes / GB:.3f} GB) tokens={a.tokens}"
        f" load_before={readrate.load_text()}"
    )
    prods = {"new": lambda: headq8.matmul(q, s, x)}
    if a.compare:
        old = module_at(a.compare)
        prods[a.compare] = lambda: old.matmul(q, s, x)
    ref = prods["new"]()  # compiles
    for k, f in prods.items():
        if not np.array_equal(f().view(np.uint32), ref.view(np.uint32)):
            raise SystemExit(f"{k}: bits differ from the new driver")
    buf = readrate.buffer()
    times: dict[tuple, list] = {(t, k): [] for t in a.threads for k in [*prods, "read"]}
    for _ in range(a.reps):
        for t in a.threads:
            numba.set_num_threads(t)
            for k, f in prods.items():
                t0, c0 = time.perf_counter(), time.process_time()
                f()
                times[(t, k)].append((time.perf_counter() - t0, time.process_time() - c0))
            r = readrate.read_rate(t, buf, repeat=1)
            times[(t, "read")].append((r.wall_gbps, r.cpu_gbps))
    print(f"# threading_layer={numba.threading_layer()} load_after={readrate.load_text()}")
    for t in a.threads:
        rw = statistics.median(w for w, _ in times[(t, "read")])
        rc = statistics.median(c for _, c in times[(t, "read")])
        print(f"threads={t} read_rate={rw:.1f} GB/s wall, {rc:.1f} per thread-CPU s (median of {a.reps})")
        for k in prods:
            wall = statistics.median(w for w, _ in times[(t, k)])
            cpus = statistics.median(c for _, c in times[(t, k)])
            print(
                f"threads={t} head={k}: {wall * 1e3:.1f} ms wall, {cpus * 1e3:.1f} ms CPU,"
                f" {nbytes / wall / GB:.1f} GB/s wall, {nbytes / (cpus / t) / GB:.1f} per thread-CPU s,"
                f" time/(bytes at read rate) = {wall / (nbytes / (rw * GB)):.2f} wall,"
                f" {(cpus / t) / (nbytes / (rc * GB)):.2f} CPU"
            )


if __name__ == "__main__":
    main()
