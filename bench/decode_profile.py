"""Where a decode step's time goes with every weight in RAM: per phase and per product, 1 and 2 threads.

    python bench/decode_profile.py CHECKPOINT [--budget 10] [--gen 32] [--threads 1 2] [--rounds 2]
        [--numerics fast] [--trunk DIR] [--compare-head | --head-at REV]

One process: `Runtime` at --budget (which must hold every expert the run touches), one greedy
generation from a fixed short prompt to load and compile everything, then --rounds rounds of the
same generation, the thread counts alternating inside each round (a load change hits all).
Per thread count it prints the median over rounds of: ms per decode step by phase
(`RunStats.decode_profile`: experts / trunk / head compute, read waits, sampler, other), and per
one-token product kind (the fast backend's entry point, weight kind, rows x cols) its calls per
step, ms per step, GB/s of the weight bytes it read and CPU ms per step (process CPU: every
thread). The prompt's last-position head call is counted with the steps (1 of --gen). The ids of
every generation must agree (with each other and across thread counts), else it exits non-zero.
Prints the numerics (the commands' default, fast, unless --numerics says otherwise), the
machine's load and the kernel thread layer; per thread count the read rate (`measure/readrate.py`,
after the rounds) and the head's GB/s per wall second against it.
--compare-head (fast, a pack with the int8 head copy): every round runs each thread count twice, with the int8 head and with the BF16 head (the copy
taken off the loaded head), printed as `threads=T head=int8|bf16`; the ids must agree within
each head (the two heads may pick different ids). --head-at REV: the same with this tree's int8
head kernel and git revision REV's (`kernels/headq8.py` loaded beside it; `threads=T head=this|REV`),
whose ids must agree with each other too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from dataclasses import replace

import numba
import numpy as np
from head_rate import module_at  # bench/, on the path as this script's folder

from dsv4stream import kernels
from dsv4stream.kernels import fast, headq8
from dsv4stream.kernels.head import copy_runs
from dsv4stream.measure import readrate
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime

GB = 1e9
PROMPT = [0, 1000, 2000, 3000, 4000]
_calls: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])  # key -> calls, wall, cpu, bytes
_depth = [0]  # matmul_pair falls back to two matmul calls: count the outer call only


def _wrap(name: str) -> None:
    """Time every call of fast.<name> by (name, kind, rows, cols, tokens)."""
    inner = getattr(fast, name)

    def timed(*args):
        w, x = args[0], args[-1]
        w0 = w[0] if isinstance(w, (list, tuple)) else w
        ws = list(w) if isinstance(w, (list, tuple)) else list(args[:-1])
        t0, c0 = time.perf_counter(), time.process_time()
        _depth[0] += 1
        try:
            y = inner(*args)
        finally:
            _depth[0] -= 1
        if _depth[0]:
            return y
        rec = _calls[(name, w0.kind, w0.rows, w0.cols, len(ws), np.shape(x)[0] if np.ndim(x) > 1 else 1)]
        rec[0] += 1
        rec[1] += time.perf_counter() - t0
        rec[2] += time.process_time() - c0
        rec[3] += sum(v.nbytes for v in ws)
        return y

    setattr(fast, name, timed)


def read_rate(threads: int, buf: np.ndarray) -> float:
    """The machine's read rate at `threads` (`measure/readrate.py`: vector loads, 1-8 streams a
    thread, a buffer of 4x the LLC), GB per wall second, best of 3 passes."""
    return readrate.read_rate(threads, buf, repeat=3).wall_gbps


def one_round(rt: Runtime, gen: int) -> tuple[list[int], dict[str, float], dict, float]:
    _calls.clear()
    session = rt.session()
    turns0 = len(rt.engine.phases.turns)
    ids = list(session.generate(PROMPT, gen))
    turn = rt.engine.phases.turns[turns0]
    steps = turn.decode_steps
    prof = {k: v / steps * 1e3 for k, v in turn.profile.items()}
    prof["step"] = turn.decode_seconds / steps * 1e3
    return ids, prof, {k: list(v) for k, v in _calls.items()}, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--budget", type=float, default=10.0, help="GB; must hold every expert used")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--numerics", default="fast", help="exact, official or fast (the commands' default)")
    ap.add_argument("--trunk", default=None, help="packed trunk folder (default: CHECKPOINT/dsv4-trunk if packed)")
    ap.add_argument("--compare-head", action="store_true", help="alternate the int8 head copy and the BF16 head")
    ap.add_argument("--head-at", metavar="REV", help="alternate this tree's int8 head kernel and git revision REV's")
    a = ap.parse_args()
    if a.compare_head and a.head_at:
        raise SystemExit("--compare-head and --head-at: one at a time")
    for name in ("matvec", "matmul", "matmul_pair", "matmul_grouped"):
        _wrap(name)
    opts = RunOptions(budget=int(a.budget * GB), threads=max(a.threads), numerics=a.numerics, trunk=a.trunk)
    with Runtime.open(a.checkpoint, opts) as rt:
        heads = {"": rt.trunk.head()}
        if a.compare_head:
            if heads[""].q8 is None:
                raise SystemExit("--compare-head: this run has no int8 head copy (fast numerics and a pack holding it)")
            heads = {"int8": heads[""], "bf16": replace(heads[""], q8=None)}
        kern = dict.fromkeys(heads, headq8.matmul)
        if a.head_at:
            heads = {"this": heads[""], a.head_at: heads[""]}
            kern = {"this": headq8.matmul, a.head_at: module_at(a.head_at).matmul}
        refs = {}
        for h, top in heads.items():
            rt.trunk._head, headq8.matmul = top, kern[h]
            refs[h], _, _, _ = one_round(rt, a.gen)  # loads every expert the prompt routes to, compiles
        if a.head_at and refs["this"] != refs[a.head_at]:
            raise SystemExit(f"--head-at: the ids differ: {refs['this']} vs {refs[a.head_at]}")
        per: dict[tuple, list] = {(t, h): [] for t in a.threads for h in heads}
        for _ in range(a.rounds):
            for t in a.threads:
                kernels.set_threads(t)
                for h, top in heads.items():
                    rt.trunk._head, headq8.matmul = top, kern[h]
                    ids, prof, calls, steps = one_round(rt, a.gen)
                    if ids != refs[h]:
                        raise SystemExit(f"ids differ at {t} threads: {ids} vs {refs[h]}")
                    per[(t, h)].append((prof, calls, steps))
        read = rt.store.stats().bytes_read
        numerics = rt.stats().numerics
        copy = a.numerics == "fast" and copy_runs()  # the int8 copy is read where it is held
        head_bytes = {h: top.q8.nbytes if copy and top.q8 is not None else top.head.nbytes for h, top in heads.items()}
    buf = readrate.buffer()
    print(
        f"# numerics={numerics} load_avg={','.join(f'{x:.2f}' for x in os.getloadavg())} threading_layer={numba.threading_layer()}"
        f" gen={a.gen} rounds={a.rounds} ids_agree=yes expert_bytes_read_total={read}"
    )
    for (t, h), runs in per.items():
        steps = runs[0][2]
        phases = {k: statistics.median(r[0][k] for r in runs) for k in runs[0][0]}
        print(f"threads={t}{' head=' + h if h else ''} ms/step " + " ".join(f"{k}={v:.2f}" for k, v in phases.items()))
        nbytes = sum(v[3] for k, v in runs[0][1].items() if k[-1] == 1) / steps
        rate = read_rate(t, buf)
        print(
            f"  weight bytes/step={nbytes / GB:.3f} GB read_rate={rate:.1f} GB/s floor={nbytes / rate / GB * 1e3:.1f} ms"
        )
        hb = head_bytes[h]
        print(
            f"  head {'int8 copy' if hb != heads[h].head.nbytes else 'bf16'} {hb / GB:.3f} GB:"
            f" {hb / (phases['head'] * 1e-3) / GB:.1f} GB/s, {phases['head'] / (hb / rate / GB * 1e3):.2f}x its"
            " bytes at the read rate"
        )
        for key in sorted(runs[0][1], key=lambda k: -runs[0][1][k][1]):
            if key[-1] != 1:
                continue  # the prompt's products (prefill), not a decode step's
            wall = statistics.median(r[1][key][1] for r in runs) / steps
            cpu = statistics.median(r[1][key][2] for r in runs) / steps
            calls, nbytes = runs[0][1][key][0] / steps, runs[0][1][key][3] / steps
            name, kind, rows, cols, nw, tok = key
            print(
                f"  {name} {kind} {rows}x{cols} weights={nw} tokens={tok} calls/step={calls:.1f}"
                f" ms/step={wall * 1e3:.2f} cpu_ms/step={cpu * 1e3:.2f} gbps={nbytes / wall / GB if wall else 0:.1f}"
            )


if __name__ == "__main__":
    main()
