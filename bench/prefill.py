"""Prefill cost against prompt length: bytes read, experts touched, tokens/s, peak RSS.

For each budget and prompt length, one fresh child process under `/usr/bin/time -v` (peak RSS
measured from outside): open `Runtime` at that budget, prefill a random id prompt of that length
(fixed seed) through `Session.prefill`, then decode `--gen` greedy tokens. The child records
the store's and the ring's counters around the prefill and, through the session's routing
hook, every (segment, layer, expert) the prefill routed to. The session is the run's own
(`Runtime.session`: the plan's segment, the one whose activations the budget counts).

Printed per run: budget, tokens, segment size S and segments run, expert bytes read during the prefill, distinct
(layer, expert) pairs summed over segments x expert bytes (what a read-once prefill must read at
most), their ratio, the ratio to the distinct (layer, expert) pairs of the whole prompt (a
prompt read once: 1.00), trunk bytes read / streamed-trunk bytes (trunk passes), prefill seconds and
tokens/s, decode tokens/s of the same run, the prefill/decode speed ratio, peak RSS; below it
where the prefill's seconds went (`phases.StepClock` around the prefill: products by weight
role, waits on expert and trunk reads, the rest). Then the machine: CPU model, SIMD flags, load.

    python bench/prefill.py /work/ckpt/i19-flash --budgets 2.2,5 --lengths 64,256,1024,4096
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

import numpy as np

from dsv4stream.cli.outputs import refuse_bad_output
from dsv4stream.files import atomic_write


def child(ckpt: str, budget: float, length: int, gen: int, seed: int, segment: int | None) -> dict:
    from dsv4stream.engine.phases import StepClock
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime

    opts = RunOptions(budget=int(budget * 1e9), prefill_segment=segment)
    with Runtime.open(ckpt, opts) as rt:
        cfg = rt.cfg
        touched: set[tuple[int, int, int]] = set()

        def on_route(layer: int, positions: np.ndarray, experts: np.ndarray) -> None:
            if int(positions[0]) >= length:
                return  # a decode step
            for p, row in zip(positions, experts, strict=True):
                for e in row:
                    touched.add((int(p) // seg, layer, int(e)))

        # the run's own session: the plan's segment, whose activations the budget counts (a
        # session made here with the engine's default segment would hold a larger one)
        session = rt.session(on_route=on_route)
        seg = session.segment
        ran = [0]

        def on_layer(step) -> None:
            ran[0] = step.segments

        ids = np.random.default_rng(seed).integers(2, cfg.vocab_size, size=length)
        s0, r0 = rt.store.stats(), rt.trunk.stats()
        clock = StepClock(rt.counters)
        clock.begin()
        t0 = time.perf_counter()
        logits = session.prefill(ids, last_only=True, on_layer=on_layer)
        prefill_s = time.perf_counter() - t0
        _, spent = clock.end()
        s1, r1 = rt.store.stats(), rt.trunk.stats()
        t0 = time.perf_counter()
        for _ in range(gen):
            logits = session.step(int(np.argmax(logits)))
        decode_s = time.perf_counter() - t0
        streamed = sum(rt.trunk.layout.layer_bytes[rt.trunk.pinned :])
        return {
            "budget": budget,
            "tokens": length,
            "segment": seg,
            "segments": ran[0],
            "planned_segment": rt.plan.prefill_segment,
            "planned_bytes": rt.plan.planned_bytes,
            "slots": s1.slots,
            "expert_bytes_read": s1.bytes_read - s0.bytes_read,
            "touched_pairs": len(touched),
            "distinct_pairs": len({(layer, e) for _, layer, e in touched}),
            "slot_bytes": s1.slot_bytes,
            "expert_bytes": cfg.expert_bytes,
            "trunk_bytes_read": r1.bytes_read - r0.bytes_read,
            "streamed_trunk_bytes": streamed,
            "prefill_s": prefill_s,
            "prefill_profile": {k: round(v, 3) for k, v in spent.items()},
            "decode_tok_s": gen / decode_s if gen else 0.0,
        }


def run_one(ckpt: str, budget: float, length: int, gen: int, seed: int, segment: int | None) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, __file__, "--child", ckpt, "--budgets", f"{budget:g}"]
    cmd += ["--lengths", str(length), "--gen", str(gen), "--seed", str(seed)]
    if segment is not None:
        cmd += ["--segment", str(segment)]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if p.returncode:
        tail = (p.stderr.strip().splitlines() or ["failed"])[-1]
        return {"budget": budget, "tokens": length, "error": tail}
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    rec["peak_rss"] = int(m.group(1)) * 1024 if m else 0
    return rec


def show(rec: dict) -> str:
    if "error" in rec:
        return f"{rec['budget']:>6g} {rec['tokens']:>6}  error: {rec['error']}"
    need = rec["touched_pairs"] * rec["expert_bytes"]
    ratio = rec["expert_bytes_read"] / need if need else 0.0
    once = rec.get("distinct_pairs", 0) * rec["expert_bytes"]
    over = rec["expert_bytes_read"] / once if once else 0.0
    passes = rec["trunk_bytes_read"] / rec["streamed_trunk_bytes"] if rec["streamed_trunk_bytes"] else 0.0
    tok_s = rec["tokens"] / rec["prefill_s"]
    speed = tok_s / rec["decode_tok_s"] if rec["decode_tok_s"] else 0.0
    return (
        f"{rec['budget']:>6g} {rec['tokens']:>6} {rec['segment']:>5} {rec['segments']:>4} {rec['slots']:>5}"
        f" {rec['expert_bytes_read'] / 1e9:>8.2f} {rec['touched_pairs']:>6} {need / 1e9:>8.2f} {ratio:>5.2f}"
        f" {over:>5.2f}"
        f" {passes:>6.1f} {rec['prefill_s']:>8.1f} {tok_s:>7.1f} {rec['decode_tok_s']:>6.2f} {speed:>6.1f}"
        f" {rec['peak_rss'] / 1e9:>6.2f}\n"
        "       prefill s: " + ", ".join(f"{k} {v:.2f}" for k, v in rec["prefill_profile"].items() if v)
    )


HEADER = (
    "budget tokens     S segs slots  read_GB  pairs  need_GB ratio xonce trunkx prefill_s   tok/s dec/s  ratio  rss_GB\n"
    "(read_GB: expert bytes read in the prefill; pairs: distinct (segment, layer, expert); need_GB: pairs x"
    " expert bytes; xonce: read_GB / the bytes of the distinct (layer, expert) the whole prompt touches;"
    " trunkx: streamed-trunk passes; dec/s: decode tok/s; ratio: prefill/decode tok/s)"
)


def machine() -> str:
    from dsv4stream.measure.machine import machine_line

    return f"machine: {machine_line()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--budgets", default="2.2,5")
    ap.add_argument("--lengths", default="64,256,1024,4096")
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--segment", type=int, default=None, help="--prefill-segment for every run")
    ap.add_argument("--json", help="also write the records here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    refuse_bad_output(a.json, "--json")  # never over a checkpoint or pack file
    budgets = [float(b) for b in a.budgets.split(",")]
    lengths = [int(n) for n in a.lengths.split(",")]
    if a.child:
        print(json.dumps(child(a.checkpoint, budgets[0], lengths[0], a.gen, a.seed, a.segment)))
        return
    print(machine())
    print(HEADER)
    recs = []
    for b in budgets:
        for n in lengths:
            recs.append(run_one(a.checkpoint, b, n, a.gen, a.seed, a.segment))
            print(show(recs[-1]), flush=True)
    print(machine())
    if a.json:
        atomic_write(a.json, json.dumps(recs, indent=1) + "\n")


if __name__ == "__main__":
    main()
