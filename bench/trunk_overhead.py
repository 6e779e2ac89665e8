"""A decode step's time outside the weight products, numpy's small steps against `kernels.trunkops`,
alternating in one process (issue 44).

    python bench/trunk_overhead.py CHECKPOINT [--numerics fast] [--threads 1 2] [--gen 6]
        [--rounds 3] [--budget 3] [--prompt-ids 0,100,2000,30000]

One Runtime (trunk resident), one warm-up generation per setting (compiles both), then --rounds
rounds; in each, per thread count, one generation with the trunk's small steps in numpy
(`model.ops.set_fused(False)`: the window keys by `WindowCache.with_new` too) and one with them
fused (the default: `kernels.trunkops`, `WindowCache.ordered`), in that order. Per generation,
per decode step: the wall ms, the process CPU ms, the products' CPU ms (`kernels.kernel_seconds`
of every role, what `bench/exact_structure.py --measure` divides by the bytes, clocked here by
`time.process_time`: a loaded machine stretches wall time, not CPU time) and the rest ("outside":
norms, hyper-connections, RoPE, attention over the cache, the compressors' and the indexer's glue,
the routing, Python; at 2 threads also what the idle worker spins beside the serial parts).
Prints each round and per setting the median of each figure over the rounds, the load, and whether
every generation gave the same ids (the two settings compute the same bits: they must). The
machine line gives the CPU, its SIMD flags and the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_floor import machine  # bench/ is on sys.path: the script's own folder

GB = 1e9


def _timed(rt, kernels, prompt: list[int], gen: int) -> dict:
    it = rt.session().generate(prompt, gen)
    ids = [next(it)]  # the prefill stays out
    k0, w0, c0 = kernels.kernel_seconds(), time.perf_counter(), time.process_time()
    ids += list(it)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    k1 = kernels.kernel_seconds()
    steps = len(ids) - 1
    prod = {r: (k1.get(r, 0.0) - k0.get(r, 0.0)) / steps * 1e3 for r in k1}
    return {
        "ids": ids,
        "ms": wall / steps * 1e3,
        "cpu": cpu / steps * 1e3,
        "products": sum(prod.values()),
        "trunk": prod.get("trunk", 0.0),
        "outside": cpu / steps * 1e3 - sum(prod.values()),
        "load": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--numerics", default="fast")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--gen", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--prompt-ids", default="0,100,2000,30000")
    a = ap.parse_args()
    if a.gen < 2:
        ap.error("--gen must be at least 2 (the first token is the prompt's; the steps after it are timed)")

    from dsv4stream import kernels
    from dsv4stream.kernels import experts_q8, head
    from dsv4stream.model import ops
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime

    # the products' clock: process CPU seconds (the kernels time each product, the head and the
    # routed experts' drivers with their module's `time.perf_counter`)
    for mod in (kernels, head, experts_q8):
        mod.time = types.SimpleNamespace(perf_counter=time.process_time)
    prompt = [int(v) for v in a.prompt_ids.split(",")]
    opts = RunOptions(budget=int(a.budget * GB), threads=max(a.threads), numerics=a.numerics, speculate="off")
    print(machine(), flush=True)
    settings = (("numpy", False), ("fused", True))
    got: dict[tuple[int, str], list[dict]] = {}
    ids = set()
    with Runtime.open(a.checkpoint, opts) as rt:
        kernels.set_threads(max(a.threads))
        for _, on in settings:
            ops.set_fused(on)
            list(rt.session().generate(prompt, a.gen))
        for r in range(a.rounds):
            for t in a.threads:
                kernels.set_threads(t)
                for name, on in settings:
                    ops.set_fused(on)
                    m = _timed(rt, kernels, prompt, a.gen)
                    ids.add(tuple(m.pop("ids")))
                    got.setdefault((t, name), []).append(m)
                    print(
                        f"round {r + 1} threads {t} {name}: step {m['ms']:.1f} ms, CPU {m['cpu']:.1f} ms = products"
                        f" {m['products']:.1f} (trunk {m['trunk']:.1f}) + outside the products {m['outside']:.1f};"
                        f" load {m['load']:.2f}",
                        flush=True,
                    )
        ops.set_fused(True)
    print(f"\nmedian of {a.rounds} rounds, {a.gen - 1} decode steps each, numerics {a.numerics}:")
    for (t, name), ms in got.items():
        med = {k: statistics.median(m[k] for m in ms) for k in ms[0]}
        print(
            f"  threads {t} {name:5}: step {med['ms']:.1f} ms, CPU {med['cpu']:.1f} ms = products {med['products']:.1f}"
            f" (trunk {med['trunk']:.1f}) + outside the products {med['outside']:.1f}; load {med['load']:.2f}"
        )
    print(f"ids: {'the same in every generation' if len(ids) == 1 else 'DIFFER between generations'}")
    print(machine())
    if len(ids) != 1:
        sys.exit(1)


if __name__ == "__main__":
    main()
