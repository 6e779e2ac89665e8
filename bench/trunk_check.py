"""What the packed trunk's checks cost: the cheap one on every open, the full one of --verify.

Builds (once, into OUT) a generated checkpoint with V4-Flash's embed and head (vocab 129280 x
hidden 4096, BF16: 1.06 GB each; preset flash-experts with 8 routed experts) and packs its
trunk. Then times, each in this process on the pack as the page cache holds it:
- `TrunkFile.open` (manifest and size checks, one probe per run, the embedding's word sum);
- the word sum (format.word_sum) of every run held in memory: what runs read the first time;
- `TrunkFile.verify` (blake2b of every run: `--verify` and `dsv4 inspect`).
Prints one line with GB, seconds and GB/s of each, and the machine state.

Usage: bench/trunk_check.py OUT
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from dsv4stream.checkpoint import synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.trunkpack.format import word_sum
from dsv4stream.trunkpack.packdir import default_out_dir
from dsv4stream.trunkpack.reader import TrunkFile
from dsv4stream.trunkpack.writer import pack_trunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
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
    t_sum = 0.0
    for key in tf.runs:
        buf = tf.read_run(key, verify=False)
        t0 = time.perf_counter()
        word_sum(buf)
        t_sum += time.perf_counter() - t0
        del buf
    t0 = time.perf_counter()
    tf.verify()
    t_full = time.perf_counter() - t0
    g = 1e9
    print(
        f"trunk {total / g:.2f} GB (embed {embed / g:.2f} GB): open (cheap checks + embed word sum) {t_open:.2f} s;"
        f" word sum of every run in memory {t_sum:.2f} s ({total / g / t_sum:.1f} GB/s);"
        f" blake2b of every run (--verify, inspect) {t_full:.2f} s ({total / g / t_full:.2f} GB/s);"
        f" load {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs; {np.__version__=}"
    )


if __name__ == "__main__":
    main()
