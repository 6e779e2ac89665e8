"""What the packed trunk's checks cost, against what the disk delivers in the same run.

Builds (once, into OUT) a generated checkpoint with V4-Flash's embed and head (vocab 129280 x
hidden 4096, BF16: 1.06 GB each; preset flash-experts with 8 routed experts) and packs its
trunk. Then, each in this process:
- `TrunkFile.open` (manifest and size checks, one probe per run, the embedding's xxh3);
- xxh3 (format.fast_hash) of every run already in memory: what every read of a run adds
  (the timed window holds the hashing only, not the read), in wall seconds and in this
  thread's CPU seconds (on a shared, loaded machine the CPU figure is the hash's own speed);
- `TrunkFile.verify` (blake2b of every run, read from the page cache: `--verify`, `inspect`,
  `upgrade-trunk`);
- the disk: O_DIRECT reads of trunk.bin at queue depth 2 for --seconds (the expert store's
  FileSet, as `dsv4 doctor` measures), so the ratio xxh3 / disk says how far the check is
  from ever being what limits a read.
Prints one line with GB, seconds and GB/s of each, the ratio, and the machine state.

Usage: bench/trunk_check.py OUT [--seconds S]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from dsv4stream import synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.measure.doctor import read_bandwidth
from dsv4stream.trunkpack.format import TRUNK_FILE, fast_hash
from dsv4stream.trunkpack.packdir import default_out_dir
from dsv4stream.trunkpack.reader import TrunkFile
from dsv4stream.trunkpack.writer import pack_trunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seconds", type=float, default=3.0, help="Disk read time.")
    a = ap.parse_args()
    ckpt = a.out / "ckpt"
    if not (ckpt / "config.json").exists():
        synth.make_checkpoint(ckpt, "flash-experts", seed=0, n_routed_experts=8)
    pack_trunk(ckpt, progress=False)
    cat = Catalog.open(ckpt)
    t0 = time.perf_counter()
    tf = TrunkFile.open(default_out_dir(ckpt), cat)
    t_open = time.perf_counter() - t0
    embed = tf.run("embed").nbytes
    total = sum(r.nbytes for r in tf.runs.values())
    t_fast = c_fast = 0.0
    for key in tf.runs:
        buf = tf.read_run(key, verify=False)
        t0, c0 = time.perf_counter(), time.thread_time()
        fast_hash(buf)
        t_fast += time.perf_counter() - t0
        c_fast += time.thread_time() - c0
        del buf
    t0, c0 = time.perf_counter(), time.thread_time()
    tf.verify()
    t_full, c_full = time.perf_counter() - t0, time.thread_time() - c0
    disk = read_bandwidth(default_out_dir(ckpt) / TRUNK_FILE, 13_369_344, (2,), a.seconds)[0]
    g = 1e9
    fast, fast_cpu = total / g / t_fast, total / g / c_fast
    print(
        f"trunk {total / g:.2f} GB (embed {embed / g:.2f} GB): open (checks + embed xxh3) {t_open:.2f} s;"
        f" xxh3 of every run in memory {t_fast:.2f} s wall ({fast:.1f} GB/s), {c_fast:.2f} s CPU"
        f" ({fast_cpu:.1f} GB/s per busy core); blake2b of every run (--verify, inspect, upgrade-trunk, read from"
        f" the page cache) {t_full:.2f} s wall ({total / g / t_full:.2f} GB/s), {c_full:.2f} s CPU"
        f" ({total / g / c_full:.2f} GB/s per busy core);"
        f" disk {disk.gbps:.2f} GB/s ({'O_DIRECT' if disk.direct else 'buffered'}, queue depth 2, 13.4 MB reads);"
        f" xxh3 / disk = {fast / disk.gbps:.1f}x wall, {fast_cpu / disk.gbps:.1f}x per busy core;"
        f" load {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
