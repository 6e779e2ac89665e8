"""First token with every expert cached: a short prompt's prefill against decode steps, in one run.

    python bench/first_token.py CHECKPOINT [--budget 10] [--lengths 1,3,7,16] [--steps 8]
        [--threads N] [--repeats 3] [--numerics fast]

One `Runtime` at --budget, which must hold every expert and the whole trunk. For each prompt
length L (the first L ids of a fixed prompt, BOS first): one warm-up generation of the prompt
plus --steps tokens (loads every expert it uses; kernels and caches hot), then --repeats times
in a fresh session of the same runtime:

  prefill   `Session.prefill(ids, last_only=True)` (the head on the last token only, as
            `generate` does). Timed window: that call alone.
  step      then --steps greedy `Session.step` calls. Timed window: each call; the median.

ratio = best prefill / median step (the target: <= ~2 for a 7-token prompt). Also per prefill:
the expert products it ran (the store's requests), its product time by weight role
(`kernels.kernel_seconds()`: experts, trunk, head, rest "other"), and bytes read from disk
(must be 0, else nothing here is a cached figure). `cpu ratio`: the same ratio in process CPU
seconds (every thread's; best prefill against median step), which a loaded machine moves less
than the wall ratio. Prints one line per length, then CPU model, SIMD flags, load and the
numerics (the commands' default, fast, unless --numerics says otherwise). The prefill's last
layer runs its last row alone (`Session._rows_used`): its expert products are those of the
first L-1 layers' L rows and one row's.

--paired N: then N prefills of each length with and without that skip, alternating in the same
process (without: a no-op trace that reads layers' outputs, which turns it off), so that a loaded
machine slows both alike: the median of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from decode_floor import machine  # bench/ is on sys.path: the script's own folder

from dsv4stream import kernels
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime


def prompt(n: int, vocab: int) -> list[int]:
    """n fixed ids spread over the vocabulary (a real prompt's routing: distinct tokens)."""
    return [(1 + 7919 * i) % vocab for i in range(n)]


def timed_prefill(rt: Runtime, ids: list[int], steps: int) -> dict:
    s = rt.session()
    k0, c0 = kernels.kernel_seconds(), rt.counters()
    t0, u0 = time.perf_counter(), time.process_time()
    logits = s.prefill(ids, last_only=True)
    secs, cpu = time.perf_counter() - t0, time.process_time() - u0
    k1, c1 = kernels.kernel_seconds(), rt.counters()
    split = {r: k1.get(r, 0.0) - k0.get(r, 0.0) for r in ("experts", "trunk", "head")}
    split["other"] = secs - sum(split.values())
    step_secs, step_cpu, tok = [], [], int(logits.argmax())
    for _ in range(steps):
        t0, u0 = time.perf_counter(), time.process_time()
        tok = int(s.step(tok).argmax())
        step_secs.append(time.perf_counter() - t0)
        step_cpu.append(time.process_time() - u0)
    return {
        "prefill": secs,
        "step": statistics.median(step_secs),
        "prefill_cpu": cpu,
        "step_cpu": statistics.median(step_cpu),
        "products": c1.expert_requests - c0.expert_requests,
        "read": c1.expert_bytes_read - c0.expert_bytes_read + c1.trunk_bytes_read - c0.trunk_bytes_read,
        "split": split,
    }


def _reads_everything(what: str, layer: int, x) -> None:
    """A trace that reads layers' outputs: the session then computes every row of the last layer."""


def paired(rt: Runtime, ids: list[int], n: int) -> str:
    """Median prefill seconds with and without the last layer's row skip, alternating."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(n):
        for skip in (True, False):
            s = rt.session(trace=None if skip else _reads_everything)
            t0 = time.perf_counter()
            s.prefill(ids, last_only=True)
            times[skip].append(time.perf_counter() - t0)
    a, b = statistics.median(times[True]), statistics.median(times[False])
    return f"paired x{n}: prefill with the row skip {a * 1e3:.0f} ms, without {b * 1e3:.0f} ms, ratio {a / b:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--budget", type=float, default=10.0, help="GB; must cache every expert")
    ap.add_argument("--lengths", default="7", help="comma-separated prompt lengths")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="kernel threads")
    ap.add_argument("--numerics", default="fast", help="exact, official or fast (the commands' default)")
    ap.add_argument("--paired", type=int, default=0, help="prefills with and without the row skip, alternating")
    args = ap.parse_args()
    opts = RunOptions(budget=int(args.budget * 1e9), threads=args.threads, numerics=args.numerics)
    with Runtime.open(args.checkpoint, opts) as rt:
        vocab = rt.engine.cfg.vocab_size
        print(
            f"# {machine()} threads={args.threads or 'default'} budget={args.budget} GB numerics={rt.stats().numerics}",
            flush=True,
        )
        for n in (int(x) for x in args.lengths.split(",")):
            ids = prompt(n, vocab)
            for _ in rt.generate(rt.session(), ids, args.steps + 1):
                pass
            runs = [timed_prefill(rt, ids, args.steps) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["prefill"])
            step = statistics.median(r["step"] for r in runs)
            cpu = min(r["prefill_cpu"] for r in runs) / statistics.median(r["step_cpu"] for r in runs)
            split = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in best["split"].items())
            print(
                f"L={n}: prefill {best['prefill'] * 1e3:.0f} ms (all {[round(r['prefill'] * 1e3) for r in runs]}),"
                f" step {step * 1e3:.0f} ms, ratio {best['prefill'] / step:.2f} (cpu ratio {cpu:.2f}), expert products"
                f" {best['products']}, read {best['read'] / 1e6:.1f} MB | {split}",
                flush=True,
            )
            if args.paired:
                print(f"L={n}: {paired(rt, ids, args.paired)}", flush=True)
        print(f"# {machine()}")


if __name__ == "__main__":
    main()
