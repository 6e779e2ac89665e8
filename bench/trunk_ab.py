"""The trunk's fast FP8 / BF16 products with another tree's `kernels/bf16.py` against this one's, in one process.

    git show main:dsv4stream/kernels/bf16.py > /tmp/bf16_base.py
    python bench/trunk_ab.py CHECKPOINT --baseline /tmp/bf16_base.py [--threads 1 2] [--gen 4] [--rounds 3] [--budget 3]

One Runtime (trunk resident, fast numerics), one warm-up generation per arm, then per thread
count and round the same greedy generation once with each arm's drivers (`bf16._DRIVERS`
swapped; the baseline module is loaded beside the package's, uncached, so its kernels are its
own), the arm that goes first alternating by round: a load change on the shared machine hits
both. Per arm it sums, over the decode steps (the prefill stays out), the process CPU and wall
seconds of every one-token trunk product (role "trunk": `kernels.matvec`, `matmul`,
`matmul_pair`, `matmul_grouped`), timed by `bench/trunk_products.py`'s wrapper. The ids of
the two arms must agree token for token (the kernels keep their bits). Prints per round and
in total the CPU ms per token of each arm and base / this, and the read rate of the thread
count (`measure.readrate`, as `bench/exact_structure.py --measure`) once per thread count, so
the trunk ratio of each arm is CPU ms against bytes at that rate.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_floor import machine  # bench/ is on sys.path: the script's own folder
from trunk_products import _stats, _Timing  # the same timed calls, keyed by role and shape

from dsv4stream.measure import readrate

GB = 1e9


def baseline_drivers(path: Path) -> dict:
    """A dict standing in for `bf16._DRIVERS` whose drivers are built by the module at path."""
    spec = importlib.util.spec_from_file_location("dsv4stream.kernels._bf16_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mod._JIT["cache"] = False  # the same function names as this tree's: numba's cache would mix them

    class Built(dict):
        def __missing__(self, key):
            self[key] = mod._driver(*key)
            return self[key]

        def __contains__(self, key):  # `bf16._drive` asks first: build here, never with this tree's
            return self[key] is not None

    return Built()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--baseline", type=Path, required=True, help="another tree's dsv4stream/kernels/bf16.py")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--gen", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--prompt-ids", default="0,100,2000,30000")
    a = ap.parse_args()

    from dsv4stream import kernels
    from dsv4stream.kernels import bf16
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime

    inner = kernels._products
    kernels._products = lambda: _Timing(inner())
    arms = {"base": baseline_drivers(a.baseline), "this": bf16._DRIVERS}
    prompt = [int(v) for v in a.prompt_ids.split(",")]
    opts = RunOptions(budget=int(a.budget * GB), threads=max(a.threads), numerics="fast", speculate="off")
    buf = readrate.buffer(None)
    print(machine(), flush=True)

    def run(arm: str) -> tuple[list[int], float, float, int, int]:
        bf16._DRIVERS = arms[arm]
        it = rt.session().generate(prompt, a.gen)
        ids = [next(it)]  # the prefill stays out
        _stats.clear()
        ids += list(it)
        trunk = [v for k, v in _stats.items() if k[0] == "trunk"]  # [calls, bytes, CPU s, wall s]
        cpu, wall, nbytes = (sum(v[i] for v in trunk) for i in (2, 3, 1))
        return ids, cpu, wall, nbytes, len(ids) - 1

    with Runtime.open(a.checkpoint, opts) as rt:
        kernels.set_threads(max(a.threads))
        for arm in arms:  # compiles each arm's kernels outside the timing
            run(arm)
        for t in a.threads:
            kernels.set_threads(t)
            rate = readrate.read_rate(t, buf)
            tot = {arm: [0.0, 0.0, 0, 0] for arm in arms}
            print(f"\n{t} thread{'s' * (t > 1)}: read rate {rate.line()}, load {readrate.load_text()}", flush=True)
            for r in range(a.rounds):
                order = list(arms) if r % 2 == 0 else list(arms)[::-1]
                got = {}
                for arm in order:
                    ids, cpu, wall, nbytes, steps = run(arm)
                    got[arm] = ids
                    for i, v in enumerate((cpu, wall, nbytes, steps)):
                        tot[arm][i] += v
                    print(
                        f"  round {r} {arm:4}: trunk {cpu / steps * 1e3:6.1f} CPU ms / {wall / steps * 1e3:6.1f} wall ms"
                        f" a token ({nbytes / steps / 1e6:.0f} MB), load {readrate.load_text()}",
                        flush=True,
                    )
                if got["base"] != got["this"]:
                    raise SystemExit(f"trunk_ab: the arms' ids differ: {got['base']} vs {got['this']}")
            line = []
            for arm, (cpu, wall, nbytes, steps) in tot.items():
                gbps = nbytes / (cpu / t) / GB
                line.append(
                    f"{arm} {cpu / steps * 1e3:.1f} CPU ms ({gbps:.2f} GB per thread-CPU-s, ratio"
                    f" {rate.cpu_gbps / gbps:.2f}), wall {wall / steps * 1e3:.1f} ms (ratio"
                    f" {rate.wall_gbps / (nbytes / wall / GB):.2f})"
                )
            print(f"  total: {'; '.join(line)}; base / this CPU {tot['base'][0] / tot['this'][0]:.2f}x", flush=True)
    del buf


if __name__ == "__main__":
    main()
