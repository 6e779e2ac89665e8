"""A full-size dry run on an exact-structure V4-Flash checkpoint: validate, plan, greedy under --budget.

The checkpoint (`synth` presets `flash` = the May preview, `flash-0731` = DeepSeek-V4-Flash-0731)
has every tensor of the release at its real shape, dense weights random, routed experts as
sparse-file holes (they read as zeros, so expert reads cost no disk and the MoE adds nothing:
the figures are the trunk's, the attention's and the head's at real dimensions). With
`--make`, it is generated first (about 9 GB of real disk, 15 minutes on 2 cores).

Three steps, each timed alone and printed as one line:
1. validate: `Catalog.open` + `validate` (headers only): shards, tensors, bytes, layout.
2. plan: the planner's split of `--budget` as `dsv4 run` prints it (dsv4 inspect --budget).
3. run: `/usr/bin/time -v dsv4 run CKPT --prompt-ids IDS --greedy --gen N --budget B
   --stats-json F` in a fresh process; peak RSS is `time`'s "Maximum resident set size" (the
   process measured from outside, its whole life: imports, planning, loading, prefill, decode),
   beside the run's own VmHWM and the budget. Timed window for s/token: decode steps only.
Then the machine: CPU model, SIMD flags, load average.

`--measure` (issue 44) instead measures compute against bytes in one process, on a checkpoint
whose routed experts are REAL (made with `--make ... --layers L --experts E`: the first L layers
at real dimensions, E routed experts of the real size, not holes), trunk resident, for each
`--numerics` in turn, one Runtime each: (1) one greedy generation to load every expert it routes
to and compile; then for each `--threads` count (default 1 and 2): (2) the machine's memory read
rate at that count (`dsv4stream.measure.readrate`: 64-byte vector loads, 1-8 streams per thread,
a buffer 4x the LLC and at least 1 GiB, first touch excluded, best of 5 per wall and per CPU
second) right before (3) --gen tokens timed, per decode step: the products' seconds by weight
role from the step profile (`StepClock`: `kernel_seconds` of "trunk" + "head", and "experts"),
their process CPU seconds, and the weight bytes those products read (every linear's
`QWeight.nbytes` at one token, counted in the kernel backend). Per role it prints ms/token,
GB/token, and ratio = compute time / (bytes / read rate at the run's threads), per wall second
and per CPU second (under load, the CPU figure is the one that means something): issue 44 asks
trunk <= 1.3 and experts <= 1.5. `--likwid` adds likwid-bench's `load_avx512` over the same
buffer size, an independent reader. Per-layer figures are what compares with the full model (the
full model has more layers of the same kinds, and more experts of which a token uses the same
top-k); the head is once per token at its real size either way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.measure import readrate
from dsv4stream.synth import EXACT_PRESETS, make_checkpoint
from dsv4stream.synth.v41 import EXACT_PRESETS_V41


def validate(ckpt: Path) -> str:
    t0 = time.perf_counter()
    cat = Catalog.open(ckpt)
    cat.validate()
    dt = time.perf_counter() - t0
    shards = len({e.path for e in cat.entries.values()})
    total = sum(e.nbytes for e in cat.entries.values())
    real = sum(os.stat(p).st_blocks * 512 for p in ckpt.glob("*.safetensors"))
    return (
        f"validate: {shards} shards, {len(cat.entries):,} tensors, {total:,} bytes"
        f" ({real / 1e9:.1f} GB on disk), layout {cat.config.layout}, all valid in {dt:.2f} s"
    )


def run(ckpt: Path, budget: float, gen: int, prompt: str) -> tuple[list[str], str]:
    with tempfile.TemporaryDirectory() as d:
        stats = Path(d) / "stats.json"
        dsv4 = [sys.executable, "-c", "from dsv4stream.cli import main; main()"]
        cmd = ["/usr/bin/time", "-v", *dsv4, "run", str(ckpt), "--prompt-ids", prompt, "--greedy"]
        cmd += ["--gen", str(gen), "--budget", f"{budget:g}", "--stats-json", str(stats), "--stats"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, check=False, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode:
            raise SystemExit(f"exact_structure: dsv4 run failed:\n{p.stderr[-3000:]}")
        s = json.loads(stats.read_text())
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) * 1024
    plan = [ln for ln in p.stderr.splitlines() if ln.startswith(("budget ", "  "))][:6]
    line = (
        f"run: --budget {budget:g}: peak RSS {rss / 1e9:.3f} GB from outside ({rss / (budget * 1e9):.0%} of budget;"
        f" own VmHWM {s['peak_rss_bytes'] / 1e9:.3f} GB), {len(s['generated_ids'])} tokens {s['generated_ids']},"
        f" prefill {s['prompt_tokens']} tokens in {s['prefill_seconds']:.1f} s,"
        f" decode {s['decode_seconds_per_token']:.2f} s/token, trunk read {s['trunk_bytes_read'] / 1e9:.1f} GB"
        f" ({s['trunk_pinned_layers']} pinned, {s['trunk_streamed_layers']} streamed), wall {wall:.0f} s;"
        f" {s.get('unused') or 'no mtp.* blocks'}; numerics {s['numerics']}"
    )
    if "numerics" not in p.stderr:
        raise SystemExit("exact_structure: the --stats report does not name the numerics")
    return plan, line


GB = 1e9


_bytes: dict[str, int] = {}  # role -> weight bytes read by one-token products in the window
_cpu: dict[str, float] = {}  # role -> process CPU seconds (every thread) in those products


class _Counting:
    """The kernels' product provider (the backend, or the numerics router) with each one-token
    call's weight bytes added to `_bytes` by weight role."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name not in ("matvec", "matmul", "matmul_pair", "matmul_grouped"):
            return attr

        def counted(*args):
            x = args[-1]
            if not (np.ndim(x) == 1 or np.shape(x)[0] == 1):
                return attr(*args)
            ws = list(args[0]) if isinstance(args[0], (list, tuple)) else list(args[:-1])
            c0 = time.process_time()
            y = attr(*args)
            role = ws[0].role
            _cpu[role] = _cpu.get(role, 0.0) + time.process_time() - c0
            _bytes[role] = _bytes.get(role, 0) + sum(w.nbytes for w in ws)
            return y

        return counted


def _count_bytes() -> None:
    """Route `kernels`' products through `_Counting` (what `kernels.matmul` and friends call)."""
    from dsv4stream import kernels

    inner = kernels._products
    kernels._products = lambda: _Counting(inner())
    from dsv4stream.kernels import experts_q8

    # fast's routed FP4 experts: a layer's driver calls (`experts_q8.Layer`), not the products above
    def counted(method, weights_of):
        def run(self, *args):
            if self.x.shape[0] != 1:
                return method(self, *args)
            c0 = time.process_time()
            y = method(self, *args)
            role = "experts"
            _cpu[role] = _cpu.get(role, 0.0) + time.process_time() - c0
            if y is not None or method.__name__ != "whole":  # whole: None when it ran nothing
                _bytes[role] = _bytes.get(role, 0) + sum(w.nbytes for w in weights_of(*args))
            return y

        return run

    def group_weights(group):
        return [getattr(e, m) for _, e in group for m in ("w1", "w2", "w3")]

    lay = experts_q8.Layer
    lay.whole = counted(lay.whole, group_weights)
    lay.group = counted(lay.group, group_weights)
    lay.total = counted(lay.total, list)


def measure(
    ckpt: Path,
    numerics: str,
    budget: float,
    gen: int,
    threads: int | tuple[int, ...],
    prompt: list[int],
    rate_bytes: int | None = None,
    streams: tuple[int, ...] = readrate.STREAMS,
) -> dict:
    """One numerics, one Runtime: a warm-up generation, then per thread count the read rate
    (`measure.readrate`) right before a timed generation, and the decode steps' product time and
    bytes by role (see the module docstring). `rate_bytes` None: 4x the LLC, at least 1 GiB."""
    from dsv4stream import kernels
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime

    if not hasattr(measure, "counting"):
        _count_bytes()
        measure.counting = True
    counts = (threads,) if isinstance(threads, int) else tuple(threads)
    opts = RunOptions(budget=int(budget * GB), threads=max(counts), numerics=numerics, speculate="off")
    buf = readrate.buffer(rate_bytes)
    out: dict = {"by_threads": {}}
    with Runtime.open(ckpt, opts) as rt:
        kernels.set_threads(max(counts))
        list(rt.session().generate(prompt, gen))  # every expert it routes to now cached; kernels compiled
        out["numerics"] = rt.stats().numerics
        for t in counts:
            kernels.set_threads(t)
            rate = readrate.read_rate(t, buf, streams=streams)
            out["by_threads"][t] = _timed(rt, kernels, prompt, gen, rate)
    del buf
    return out


def _timed(rt, kernels, prompt: list[int], gen: int, rate: readrate.Rate) -> dict:
    """One timed generation at the kernels' current thread count, against `rate`."""
    load = os.getloadavg()
    session = rt.session()
    turns0 = len(rt.engine.phases.turns)
    reads0 = rt.store.stats().bytes_read
    it = session.generate(prompt, gen)
    ids = [next(it)]  # the prefill (and its last position's head) stays out of the window
    _bytes.clear()
    _cpu.clear()
    c0 = time.process_time()
    ids += list(it)
    step_cpu = time.process_time() - c0
    turn = rt.engine.phases.turns[turns0]
    steps = turn.decode_steps
    threads = kernels.get_threads()
    per = {k: v / steps for k, v in turn.profile.items()}
    nbytes = {k: v / steps for k, v in _bytes.items()}
    out = {
        "threads": threads,
        "load": load,
        "read_rate": asdict(rate),
        "steps": steps,
        "ids": ids,
        "step_ms": turn.decode_seconds / steps * 1e3,
        "step_cpu_ms": step_cpu / steps / threads * 1e3,
        "expert_reads_in_window": rt.store.stats().bytes_read - reads0,
        "profile_ms": {k: v * 1e3 for k, v in per.items()},
        "bytes_per_token": nbytes,
    }
    cpu = {k: v / steps / threads for k, v in _cpu.items()}  # one thread's CPU seconds per token
    roles = {"trunk+head": ("trunk", "head"), "trunk": ("trunk",), "head": ("head",), "experts": ("experts",)}
    for name, rs in roles.items():
        sec = sum(per.get(r, 0.0) for r in rs)
        c = sum(cpu.get(r, 0.0) for r in rs)
        b = sum(nbytes.get(r, 0.0) for r in rs)
        out[name] = {
            "ms": sec * 1e3,
            "gb": b / GB,
            "floor_ms": b / (rate.wall_gbps * GB) * 1e3,
            "ratio": sec / (b / (rate.wall_gbps * GB)) if b else None,
            "cpu_ms": c * 1e3,
            "cpu_floor_ms": b / (rate.cpu_gbps * GB) * 1e3,
            "cpu_ratio": c / (b / (rate.cpu_gbps * GB)) if b else None,
        }
    return out


def measure_lines(m: dict) -> str:
    parts = []
    for t, r in m["by_threads"].items():
        rate = readrate.Rate(**r["read_rate"])
        load = ",".join(f"{x:.2f}" for x in r["load"])
        parts.append(
            f"measure: numerics {m['numerics']}, {t} thread{'s' * (t > 1)}, load {load}; read rate {rate.line()};"
            f" {r['steps']} steps of {r['step_ms']:.0f} ms ({r['step_cpu_ms']:.0f} CPU ms/thread),"
            f" expert bytes read in the window {r['expert_reads_in_window']}"
        )
        for name in ("trunk+head", "trunk", "head", "experts"):
            x = r[name]
            parts.append(
                f"  {name}: {x['gb']:.3f} GB/token; wall {x['ms']:.1f} ms/token (floor {x['floor_ms']:.1f}):"
                f" ratio {x['ratio']:.2f}; CPU {x['cpu_ms']:.1f} ms/token/thread (floor {x['cpu_floor_ms']:.1f}):"
                f" ratio {x['cpu_ratio']:.2f}"
            )
    return "\n".join(parts)


def cross_check(nbytes: int | None = None, threads=(1, 2)) -> str:
    """The read rate beside likwid-bench's load_avx512 (an independent reader), back to back."""
    buf = readrate.buffer(nbytes)
    parts = []
    for t in threads:
        ours = readrate.read_rate(t, buf)
        theirs = readrate.likwid_load(t, buf.nbytes)
        other = f"likwid-bench load_avx512 {theirs:.1f} GB/s" if theirs else "likwid-bench not installed"
        parts.append(f"{t} thread{'s' * (t > 1)}: ours {ours.wall_gbps:.1f} GB/s ({ours.streams} streams), {other}")
    return (
        f"read rate over {buf.nbytes / 2**30:.2f} GiB (LLC {readrate.llc_bytes() / 2**20:.0f} MiB), per wall second: "
        + "; ".join(parts)
    )


def reduced(preset: str, layers: int | None, experts: int | None) -> dict:
    """Overrides for a checkpoint of `layers` layers at real dimensions with `experts` real routed
    experts (None, None: the release's structure, experts as holes)."""
    if layers is None and experts is None:
        return {}
    if layers is None or experts is None:
        raise SystemExit("exact_structure: --layers and --experts go together")
    if preset in EXACT_PRESETS_V41:
        from dsv4stream.synth.v41 import layer_plan

        plan = layer_plan(layers, window=2, encoder=max(1, (layers - 2) // 3))
        # real experts make every table real: Engram's 4000-id hash vocabulary keeps its tables
        # at about 100 MB (its projections, what a token multiplies, keep their real shapes)
        return {
            **plan,
            "n_routed_experts": experts,
            "dspark_n_routed_experts": experts // 2,
            "engram_vocab_size": 4000,
            "sparse_experts": False,
        }
    # one window-only layer, then ratio 4 and 128 alternating as in the release, layer 0 hashed
    ratios = [0] + [4 if i % 2 == 0 else 128 for i in range(layers - 1)]
    return {
        "num_hidden_layers": layers,
        "compress_ratios": [*ratios, 0],
        "num_hash_layers": 1,
        "n_routed_experts": experts,
        "sparse_experts": False,
    }


def machine() -> str:
    cpu = re.search(r"Model name:\s+(.+)", subprocess.run(["lscpu"], check=True, capture_output=True, text=True).stdout)
    flags = Path("/proc/cpuinfo").read_text()
    simd = sorted({f for f in re.findall(r"\b(avx2|avx512f|avx512_bf16|avx512_vnni)\b", flags)})
    return f"machine: {cpu.group(1) if cpu else '?'}, {os.cpu_count()} cpus, {' '.join(simd)}; load {os.getloadavg()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument(
        "--make", choices=(*EXACT_PRESETS, *EXACT_PRESETS_V41), help="generate the checkpoint first with this preset"
    )
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--gen", type=int, default=3)
    ap.add_argument("--prompt-ids", default="0,100,2000,30000")
    ap.add_argument("--measure", action="store_true", help="compute vs bytes at the read rate (needs real experts)")
    ap.add_argument("--numerics", nargs="+", default=["fast", "exact"], help="with --measure: each in turn")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="with --measure: each in turn")
    ap.add_argument("--likwid", action="store_true", help="with --measure: also likwid-bench's read rate")
    ap.add_argument("--layers", type=int, help="with --make: only the first N layers (real dimensions)")
    ap.add_argument("--experts", type=int, help="with --make: N routed experts of the real size, real bytes")
    ap.add_argument("--seed", type=int, default=0, help="with --make")
    ap.add_argument("--json", type=Path, help="with --measure: also write the figures here")
    args = ap.parse_args()
    if args.make:
        t0 = time.perf_counter()
        make_checkpoint(args.checkpoint, args.make, seed=args.seed, **reduced(args.make, args.layers, args.experts))
        print(f"make: {args.make} in {time.perf_counter() - t0:.0f} s", flush=True)
    print(validate(args.checkpoint), flush=True)
    if args.measure:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
        got = [measure(args.checkpoint, n, args.budget, args.gen, tuple(args.threads), prompt) for n in args.numerics]
        for m in got:
            print(measure_lines(m), flush=True)
        if args.likwid:
            print(cross_check(), flush=True)
        if args.json:
            args.json.write_text(json.dumps(got, indent=1) + "\n")
        print(machine())
        return
    plan, line = run(args.checkpoint, args.budget, args.gen, args.prompt_ids)
    for ln in plan:
        print(f"plan: {ln.strip()}")
    print(line)
    print(machine())


if __name__ == "__main__":
    main()
