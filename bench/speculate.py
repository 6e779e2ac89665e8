"""Speculative decoding: acceptance and decode tokens/s with --speculate off, 1..4 and auto, in RAM
and at a streaming budget, with the checkpoint's DSpark drafter and with a STAND-IN drafter.

Opens CHECKPOINT (a generated V4.1 one: `dsv4 generate --preset demo-v41`) through `Runtime` at two
budgets: "ram" (every expert of the main model and the drafter has a slot: after its first read
none is read again) and "stream" (slots for twice one pass's working set: experts stream from disk,
--io direct). At each budget: greedy ids of `off` first, then each setting in a fresh session on
the same prompt (ids 3, 4, ...); every setting must give off's ids (checked, the row says so).

Random weights make the checkpoint's drafter accept almost nothing, so the bench also runs a
STAND-IN drafter (rows marked `drafter=STAND-IN-p30` etc., never the checkpoint's): it proposes off's
own greedy ids, each one replaced by a wrong id with probability `miss` (0.7, 0.4, 0.1: each draft
right with probability 30, 60 or 90 %, `STAND-IN-p30` etc.; `acceptance` counts the drafts after a
first miss as not accepted, so it reads lower), to show what `auto` decides there next to a fixed N.

Timed window of a row: the decode of one generation, from the first token yielded (the prefill
excluded) to the last (every drafter run, verification pass, re-feed and pick). Ratios: decode
tokens/s against `off` at the same budget in the same process (`x_off`; off runs once first to warm
the kernels and the cache, untimed), and against the row's own estimate of its time without drafts
(`x_est` = tokens x the one-token passes it measured / its decode time: on a shared machine whose
load moves between rows, the steadier of the two), and `x_off_cpu`: off's process CPU seconds over
the row's for the same tokens (the decode's CPU time, which other processes' load moves less than
wall time; it leaves out the time waiting on reads, so streaming it says less than `x_off`).
Also per row: acceptance, mean accepted length (tokens per verification pass), drafted and
verified tokens, expert MB read per token, auto's draft lengths ({k: cycles}), its time estimate
without drafts, and its watches (drafter runs whose drafts were only compared with the picks:
`watches=N(right/drafted_right)`).
`--repeat R` runs off and the settings R times in turn (each row's x_off against the off run just
before it); `--no-stand-in` skips the stand-in rows; `--numerics` (default fast, as `dsv4 run`;
an engine opened without one runs V4.1's official grids). Prints a header (machine, load,
numerics) and one line per row; a row whose ids differ from off's says IDS-DIFFER, and the bench
then ends with a line naming every such row and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from dsv4stream.measure.machine import cpu_description

MISSES = (0.7, 0.4, 0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (ids 3, 4, ...)")
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="kernel threads (1: steady on a shared machine)")
    ap.add_argument("--budgets", default="ram,stream")
    ap.add_argument("--settings", default="off,1,2,3,4,auto")
    ap.add_argument("--repeat", type=int, default=1, help="run off and the settings this many times, alternating")
    ap.add_argument("--no-stand-in", action="store_true", help="skip the stand-in drafter's rows")
    ap.add_argument("--numerics", default=None, help="exact, official or fast (default: fast, as dsv4 run)")
    a = ap.parse_args()

    from dsv4stream.checkpoint.catalog import Catalog
    from dsv4stream.engine.numerics import RUN_DEFAULT, canonical
    from dsv4stream.engine.spec_policy import AutoDrafts, FixedDrafts
    from dsv4stream.engine.speculate import speculative_generate
    from dsv4stream.engine.speculate_v41 import ScriptedDrafter
    from dsv4stream.run import planner
    from dsv4stream.run.memory import measure
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime
    from dsv4stream.text.sampler import greedy

    numerics = canonical(a.numerics or RUN_DEFAULT)
    load = os.getloadavg()
    print(
        f"# machine: {cpu_description()} cores={os.cpu_count()} load_avg={load[0]:.2f},{load[1]:.2f},{load[2]:.2f}"
        f" numerics={numerics} threads={a.threads} prompt={a.prompt} gen={a.gen}"
    )
    differ: list[str] = []
    cfg = Catalog.open(a.checkpoint).config
    needs = measure(a.checkpoint, RunOptions(budget=1))
    budgets = {
        "ram": planner.budget_for(needs, needs.total_experts),
        "stream": planner.budget_for(needs, 2 * cfg.working_set_experts),
    }
    prompt = [3 + i for i in range(a.prompt)]

    def timed(gen) -> tuple[list[int], float, float]:
        ids, t_first, c_first = [], 0.0, 0.0
        for tok in gen:
            if not ids:
                t_first, c_first = time.perf_counter(), time.process_time()
            ids.append(tok)
        return ids, time.perf_counter() - t_first, time.process_time() - c_first

    for where in a.budgets.split(","):
        opts = RunOptions(budget=budgets[where], threads=a.threads, trunk="", numerics=numerics)
        with Runtime.open(a.checkpoint, opts) as rt:

            def row(drafter: str, setting, ids, timing, spec, base, where=where) -> None:
                seconds, cpu = timing[1], timing[2]
                rate = (len(ids) - 1) / seconds
                same = "same-ids"
                if ids != base[0]:
                    at = next((i for i, (x, y) in enumerate(zip(ids, base[0])) if x != y), min(len(ids), len(base[0])))
                    same = f"IDS-DIFFER(at {at})"
                    differ.append(f"{where}/{drafter}/{setting}")
                x = rate / base[1] if base[1] else 1.0
                x_cpu = base[2] / cpu if cpu else 1.0
                s = spec or None
                extra = ""
                if s is not None and s.seconds_without:
                    extra = f" x_est={s.seconds_without / seconds:.2f}"
                if s is not None:
                    lengths = ",".join(f"{k}:{v}" for k, v in sorted(s.lengths.items()))
                    extra += (
                        f" acceptance={s.acceptance:.2f} mean_len={s.mean_accepted_length:.2f} drafted={s.drafted}"
                        f" verified={s.verified_tokens} refeeds={s.refeeds} MB_per_tok={s.expert_bytes_per_token / 1e6:.2f}"
                        f" est_without_s={s.seconds_without:.2f} lengths={{{lengths}}}"
                    )
                    if s.watches:
                        extra += f" watches={s.watches}({s.watch_accepted}/{s.watch_drafted}_right)"
                line = (
                    f"budget={where}({budgets[where] / 1e9:.2f}GB) drafter={drafter} speculate={setting}"
                    f" tok_s={rate:.2f} x_off={x:.2f} x_off_cpu={x_cpu:.2f} decode_s={seconds:.2f} cpu_s={cpu:.2f} {same}{extra}"
                )
                print(line, flush=True)

            list(rt.generate(rt.session(), prompt, a.gen, speculate="off"))  # warm-up, untimed
            for r in range(a.repeat):  # x_off: against the off run just before (the load moves)
                s0 = rt.session()
                t_off = timed(rt.generate(s0, prompt, a.gen, speculate="off"))
                ids0 = t_off[0]
                if r == 0:
                    off = ids0
                base = (off, (len(ids0) - 1) / t_off[1], t_off[2])
                row("dspark", "off", ids0, t_off, None, base)
                for setting in a.settings.split(","):
                    if setting == "off":
                        continue
                    s = rt.session()
                    got = timed(rt.generate(s, prompt, a.gen, speculate=setting))
                    row("dspark", setting, got[0], got, s.turn.speculation, base)
            full = [*prompt, *off]
            for miss in () if a.no_stand_in else MISSES:
                for setting in ("auto", 3):
                    rng = np.random.default_rng(7)

                    def propose(pos: int, token: int, k: int, rng=rng, miss=miss, full=full) -> list[int]:
                        want = full[pos + 2 : pos + 2 + k]
                        return [t if rng.random() >= miss else (t + 1) % cfg.vocab_size for t in want]

                    s = rt.session()
                    policy = AutoDrafts(cfg.dspark.block_size) if setting == "auto" else FixedDrafts(setting)
                    gen = speculative_generate(
                        s, prompt, a.gen, greedy, ScriptedDrafter(propose, cfg.dspark.block_size), policy,
                        setting=setting, max_pos=opts.ctx,
                    )  # fmt: skip
                    got = timed(gen)
                    row(f"STAND-IN-p{round(100 * (1 - miss))}", setting, got[0], got, s.turn.speculation, base)
    if differ:
        print(f"# IDS-DIFFER: {len(differ)} row(s) gave other greedy ids than off: {', '.join(differ)}", flush=True)
        raise SystemExit(1)
    print("# every row gave off's greedy ids", flush=True)


if __name__ == "__main__":
    main()
