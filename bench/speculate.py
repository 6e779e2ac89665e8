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
first miss as not accepted, so it reads lower), to show what `auto` decides there next to the
fixed N of `--settings`.

Timed window of a row: the decode of one generation, from the first token yielded (the prefill
excluded) to the last (every drafter run, verification pass, re-feed and pick). Each budget opens
the checkpoint twice (two `Runtime`s: two expert caches, so one run's reads never warm the
other's) and runs untimed warm-ups on both (off, a fixed draft of 3 and auto: the kernels, the
multi-token passes, the expert caches). A row is then timed PAIRED with `off`: the row's
generation on one runtime and `off`'s on the other, interleaved token by token in this one
thread (one `next()` of each in turn), each timed inside its own calls (wall, and this thread's
CPU seconds). Whatever the machine does meanwhile (another process's load, the host's memory
speed, which moved +-15 % between runs minutes apart) falls on both alike, so the ratio
`x_off` (off's decode seconds over the row's, for the same tokens: > 1 faster than off) and
`x_off_cpu` (the same in thread CPU seconds; streaming, it leaves out waiting on reads) carry
little noise. The runtimes swap roles every round, and which generation steps first alternates.
The noise is measured the same way: two `off/off` pairs each round (before the first row and
after the middle one). The summary gives, per row, the median over rounds with the lowest and
highest, the off/off spread beside it, and a VERDICT: "within the noise" where the row's median
lies inside the off/off range, "SLOWER than off beyond the noise" below it, "faster than off
beyond the noise" above it (`--repeat R`: R rounds; more rounds, a narrower median and a wider,
truer noise range). A last line gives `auto`'s verdicts: issue 41's rule (never slower than
off beyond noise, in RAM and streaming; faster in RAM where acceptance is high).
Two kinds of `auto` row. `auto`: a fresh policy that starts from what the earlier runs of the
same drafter at the same budget measured (`engine.spec_memory`, as a `dsv4 run` after an earlier
one on the machine: an untimed warm-up run of each drafter first, then each timed `auto` row's
figures for the next; kept in this process, never in the user's state folder). `auto-first`: a
fresh policy with no memory (a run's first reply the first time a checkpoint runs on a machine:
it pays to learn the drafter's cost and acceptance). `dsv4 run` keeps one policy per run.
Also per row: acceptance, mean accepted length (tokens per verification pass), drafted and
verified tokens, expert MB read per token, the draft lengths ({k: cycles}), its watches
(drafter runs whose drafts were only compared with the picks: `watches=N(right/drafted_right)`)
and `x_est` (the row's own time without drafts, from the one-token passes it timed, over its
decode time: in rows that draft it rests on few one-token passes, so x_off is the figure).
An auto row that drafted adds a `cycles:` line: its cycles by kind (verified, watched, plain,
re-fed), the measured mean seconds of its passes by length and of its drafter runs, the policy's
last t(1) and acceptance against the truth (the paired `off` run's seconds per token; the
acceptance of its verified and watched drafts), and its ledger against the measured loss.
`--drafters dspark,30,60,90` (the default) picks the rows' drafters (a stand-in by its percent
right); `--no-stand-in` skips the stand-in rows; `--numerics` (default fast, as `dsv4 run`; an engine
opened without one runs V4.1's official grids). Prints a header (machine, load, numerics) and one
line per row; a row whose ids differ from off's says IDS-DIFFER, and the bench then ends with a
line naming every such row and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

import numpy as np

from dsv4stream.measure.machine import cpu_description


class Recorded:
    """A policy, with what it was told recorded: each pass's length and seconds, each drafter run's
    seconds (the measured truth the `cycles:` line sets the policy's estimates against)."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.passes: dict[int, list[float]] = defaultdict(list)
        self.drafts: list[float] = []

    def passed(self, n: int, seconds: float, read_bytes: int, read_seconds: float) -> None:
        self.passes[n].append(seconds)
        self.policy.passed(n, seconds, read_bytes, read_seconds)

    def drafted(self, seconds: float, cold: bool = False, run: float | None = None) -> None:
        self.drafts.append(seconds)
        self.policy.drafted(seconds, cold, run)

    def __getattr__(self, name: str):
        return getattr(self.policy, name)


def paired(first, second) -> list[tuple[list[int], float, float]]:
    """Two generations run to their ends, one `next()` of each in turn (`first` first): each one's
    (ids, decode wall seconds, decode thread CPU seconds), the seconds inside its own calls from
    its first token on (the prefill and the first pick left out)."""
    gens, out = [first, second], [([], 0.0, 0.0), ([], 0.0, 0.0)]
    live = [True, True]
    while any(live):
        for i in (0, 1):
            if not live[i]:
                continue
            t, c = time.perf_counter(), time.thread_time()
            try:
                tok = next(gens[i])
            except StopIteration:
                live[i] = False
                continue
            ids, wall, cpu = out[i]
            if ids:
                wall, cpu = wall + time.perf_counter() - t, cpu + time.thread_time() - c
            ids.append(tok)
            out[i] = (ids, wall, cpu)
    return out


def cycles_line(rec: Recorded, spec, t_off: float, seconds: float, tokens: int) -> str:
    """What an auto row did and what its policy believed, against the measured truth."""
    p = rec.policy
    passes = " ".join(f"{n}:{statistics.fmean(v) * 1e3:.1f}ms*{len(v)}" for n, v in sorted(rec.passes.items()))
    draft = f"{statistics.fmean(rec.drafts) * 1e3:.1f}ms*{len(rec.drafts)}" if rec.drafts else "none"
    # the per-draft acceptance as the policy estimates it: accepted drafts over accepted drafts and
    # first rejections (re-feeds, and each watch counted as ending on a wrong draft: a low bound)
    right = spec.accepted + spec.watch_accepted
    truth = right / (right + spec.refeeds + spec.watches) if right + spec.refeeds + spec.watches else 0.0
    extra = p.verify_other.value - p.plain_other.value if p.verify_other.known and p.plain_other.known else 0.0
    loss = seconds - tokens * t_off  # against the paired off run
    # the decode's seconds outside passes and drafter runs (snapshots, restores, picks, taps), per cycle
    other = (seconds - sum(map(sum, rec.passes.values())) - sum(rec.drafts)) / max(1, spec.cycles)
    return (
        f"#   cycles: verified={spec.verify_passes} watched={spec.watches} plain={spec.steps - spec.watches}"
        f" refeeds={spec.refeeds}({spec.refeed_tokens} tokens) passes(ms by length)={{{passes}}} drafter={draft}"
        f" other={other * 1e3:.1f}ms/cycle verify_extra_policy={extra * 1e3:.1f}ms t1_policy={p.t(1) * 1e3:.1f}ms t1_off={t_off * 1e3:.1f}ms alpha_policy={p.alpha:.2f}"
        f" alpha_seen={truth:.2f} ledger={p.ledger:.2f}s loss_vs_off={loss:.2f}s"
    )


def stand_in(name: str) -> float:
    """The miss rate of a stand-in drafter's row name (`STAND-IN-p60`: 0.4)."""
    return (100 - int(name.removeprefix("STAND-IN-p"))) / 100


def drafted_run(rt, cfg, prompt: list[int], off_ids: list[int], drafter: str, setting: str, gen: int, memory=None):
    """(session, generator, recorded policy) of one drafting row, a fresh policy each (`auto`:
    starting from `memory`, what earlier runs measured; `auto-first`: from nothing)."""
    from dsv4stream.engine.spec_policy import AutoDrafts, FixedDrafts
    from dsv4stream.engine.speculate import speculative_generate
    from dsv4stream.engine.speculate_v41 import ScriptedDrafter
    from dsv4stream.text.sampler import greedy

    block = cfg.dspark.block_size
    s = rt.session()
    if setting.startswith("auto"):
        policy = Recorded(AutoDrafts(block, memory if setting == "auto" else None))
    else:
        policy = Recorded(FixedDrafts(int(setting)))
    if drafter == "dspark":
        d = rt.speculator.drafter(s)
    else:
        rng, miss, full = np.random.default_rng(7), stand_in(drafter), [*prompt, *off_ids]

        def propose(pos: int, token: int, k: int) -> list[int]:
            want = full[pos + 2 : pos + 2 + k]
            return [t if rng.random() >= miss else (t + 1) % cfg.vocab_size for t in want]

        d = ScriptedDrafter(propose, block)
    return s, speculative_generate(s, prompt, gen, greedy, d, policy, setting=setting, max_pos=rt.opts.ctx), policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (ids 3, 4, ...)")
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="kernel threads (1: steady on a shared machine)")
    ap.add_argument("--budgets", default="ram,stream")
    ap.add_argument(
        "--settings",
        default="off,1,2,3,4,auto,auto-first",
        help="off is the baseline every row is paired with; auto remembers earlier runs, auto-first does not",
    )
    ap.add_argument("--repeat", type=int, default=1, help="rounds of paired (off, row) runs; the summary's median")
    ap.add_argument("--no-stand-in", action="store_true", help="skip the stand-in drafter's rows")
    ap.add_argument(
        "--drafters", default="dspark,30,60,90", help="rows' drafters: dspark and stand-ins by percent right"
    )
    ap.add_argument("--numerics", default=None, help="exact, official or fast (default: fast, as dsv4 run)")
    a = ap.parse_args()
    bad = [d for d in a.drafters.split(",") if d != "dspark" and not (d.isdigit() and int(d) <= 100)]
    if bad:
        ap.error(f"--drafters {','.join(bad)}: give dspark or a stand-in's percent right (0-100), e.g. dspark,60")

    from dsv4stream.checkpoint.catalog import Catalog
    from dsv4stream.engine.numerics import RUN_DEFAULT, canonical
    from dsv4stream.run import planner
    from dsv4stream.run.memory import measure
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime

    numerics = canonical(a.numerics or RUN_DEFAULT)
    load = os.getloadavg()
    print(
        f"# machine: {cpu_description()} cores={os.cpu_count()} load_avg={load[0]:.2f},{load[1]:.2f},{load[2]:.2f}"
        f" numerics={numerics} threads={a.threads} prompt={a.prompt} gen={a.gen} rounds={a.repeat}"
    )
    differ: list[str] = []
    cfg = Catalog.open(a.checkpoint).config
    needs = measure(a.checkpoint, RunOptions(budget=1))
    budgets = {
        "ram": planner.budget_for(needs, needs.total_experts),
        "stream": planner.budget_for(needs, 2 * cfg.working_set_experts),
    }
    prompt = [3 + i for i in range(a.prompt)]
    settings = [x for x in a.settings.split(",") if x != "off"]
    drafters = [d if d == "dspark" else f"STAND-IN-p{int(d)}" for d in a.drafters.split(",")]
    if a.no_stand_in:
        drafters = [d for d in drafters if d == "dspark"]
    rows = [(d, st) for d in drafters for st in settings]
    summary: list[str] = []

    verdicts: list[str] = []
    for where in a.budgets.split(","):
        opts = RunOptions(budget=budgets[where], threads=a.threads, trunk="", numerics=numerics)
        label = f"budget={where}({budgets[where] / 1e9:.2f}GB)"
        with Runtime.open(a.checkpoint, opts) as ra, Runtime.open(a.checkpoint, opts) as rb:

            def off_gen(rt):
                return rt.generate(rt.session(), prompt, a.gen, speculate="off")

            # untimed warm-ups on both: kernels, multi-token passes, the expert caches, the drafter
            off_ids = list(off_gen(ra))
            for rt in (ra, rb):
                if list(off_gen(rt)) != off_ids:
                    differ.append(f"{where}/off")
                for d, st in (("dspark", "3"), ("dspark", "auto-first")):
                    list(drafted_run(rt, cfg, prompt, off_ids, d, st, min(a.gen, 32))[1])
            # what an earlier run of each drafter measured at this budget (`auto` rows start from it)
            memory: dict[str, object] = {}
            if "auto" in settings:
                for d in dict.fromkeys(d for d, _ in rows):
                    _, g, rec = drafted_run(ra, cfg, prompt, off_ids, d, "auto-first", a.gen)
                    list(g)
                    memory[d] = rec.policy.remember()
            noise: list[tuple[float, float]] = []  # off/off pairs: (wall ratio, cpu ratio)
            per_row: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
            half = (len(rows) + 1) // 2
            plan = [None, *rows[:half], None, *rows[half:]]  # None: an off/off pair (the noise)
            turn = 0
            for r in range(a.repeat):
                x_rt, y_rt = (ra, rb) if r % 2 == 0 else (rb, ra)  # off runs on x_rt, the row on y_rt
                for row in plan:
                    if row is None:
                        s = rec = None
                        g = off_gen(y_rt)
                    else:
                        s, g, rec = drafted_run(y_rt, cfg, prompt, off_ids, *row, a.gen, memory.get(row[0]))
                    o = off_gen(x_rt)
                    turn += 1
                    (off_t, got), first = (paired(o, g), "off") if turn % 2 else (paired(g, o)[::-1], "row")
                    for ids, what in ((off_t[0], "off"), (got[0], "off" if row is None else "/".join(row))):
                        if ids != off_ids:
                            at = next((j for j, (u, v) in enumerate(zip(ids, off_ids)) if u != v), len(ids))
                            differ.append(f"{where}/{what}(at {at})")
                    x, x_cpu = off_t[1] / got[1], off_t[2] / got[2] if got[2] else 1.0
                    if row is None:
                        noise.append((x, x_cpu))
                        continue
                    per_row[row].append((x, x_cpu))
                    if row[1] == "auto":  # the next auto row of this drafter starts from this one's figures
                        memory[row[0]] = rec.policy.remember() or memory.get(row[0])
                    print_row(label, row, got, off_t, s.turn.speculation, rec, first, got[0] == off_ids)
            summary.append(
                f"{label} off/off: x_off {_spread([x for x, _ in noise])} x_off_cpu {_spread([c for _, c in noise])}"
                f" over {len(noise)} pairs (the noise)"
            )
            for (d, st), xs in per_row.items():
                wall, cpu = [x for x, _ in xs], [c for _, c in xs]
                v = verdict(wall, [x for x, _ in noise])
                summary.append(
                    f"{label} drafter={d} speculate={st}: x_off {_spread(wall)} x_off_cpu {_spread(cpu)}"
                    f" -> {v} (cpu: {verdict(cpu, [c for _, c in noise])})"
                )
                if st.startswith("auto"):
                    verdicts.append(f"{where}/{d.removeprefix('STAND-IN-')}/{st}: {v.split(' (')[0]}")
    print(
        "# summary: median [lowest, highest] over rounds; x_off = off's decode seconds / the row's, paired", flush=True
    )
    for line in summary:
        print(f"# {line}", flush=True)
    if verdicts:
        print(f"# auto against off (wall): {'; '.join(verdicts)}", flush=True)
    if differ:
        print(f"# IDS-DIFFER: {len(differ)} run(s) gave other greedy ids than off: {', '.join(differ)}", flush=True)
        raise SystemExit(1)
    print("# every row gave off's greedy ids", flush=True)


def print_row(label: str, row: tuple[str, str], got, off_t, spec, rec: Recorded, first: str, same: bool) -> None:
    """One timed row: its rate against the paired off run's, and what it drafted."""
    d, st = row
    n = len(got[0]) - 1
    rate, off_rate = n / got[1], n / off_t[1]
    lengths = ",".join(f"{k}:{v}" for k, v in sorted(spec.lengths.items()))
    extra = f" x_est={spec.seconds_without / got[1]:.2f}" if spec.seconds_without else ""
    extra += (
        f" acceptance={spec.acceptance:.2f} mean_len={spec.mean_accepted_length:.2f} drafted={spec.drafted}"
        f" verified={spec.verified_tokens} refeeds={spec.refeeds}"
        f" MB_per_tok={spec.expert_bytes_per_token / 1e6:.2f} lengths={{{lengths}}}"
    )
    if spec.watches:
        extra += f" watches={spec.watches}({spec.watch_accepted}/{spec.watch_drafted}_right)"
    print(
        f"{label} drafter={d} speculate={st} tok_s={rate:.2f} off_tok_s={off_rate:.2f} x_off={off_t[1] / got[1]:.2f}"
        f" x_off_cpu={off_t[2] / got[2] if got[2] else 1.0:.2f} decode_s={got[1]:.2f} cpu_s={got[2]:.2f}"
        f" first={first} {'same-ids' if same else 'IDS-DIFFER'}{extra}",
        flush=True,
    )
    if st.startswith("auto") and spec.drafted:
        print(cycles_line(rec, spec, off_t[1] / n, got[1], n), flush=True)


def verdict(xs: list[float], noise: list[float]) -> str:
    """Where a row's median lies against the off/off range."""
    if not xs or not noise:
        return "no verdict"
    m, lo, hi = statistics.median(xs), min(noise), max(noise)
    if m < lo:
        return f"SLOWER than off beyond the noise ({m:.3f} < off/off lowest {lo:.3f})"
    if m > hi:
        return f"faster than off beyond the noise ({m:.3f} > off/off highest {hi:.3f})"
    return f"within the noise ({lo:.3f} <= {m:.3f} <= {hi:.3f})"


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]" if xs else "-"


if __name__ == "__main__":
    main()
