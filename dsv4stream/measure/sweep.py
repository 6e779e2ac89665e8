"""The live budget sweep: the same generation at each budget, each in a fresh process.

Owns: running `dsv4 run` once per budget (cold cache: a new process, direct I/O, its own
route log and stats JSON), reading its peak RSS from the kernel (`wait4`, so it is that
process's own), turning each run's stats into one record, refusing a sweep whose token ids
differ between budgets, and replaying each run's route log to check that the simulator
reproduces its LRU hits. It knows `dsv4 run` only by its command line and stats JSON.

Timed windows are `dsv4 run`'s: prefill = the prompt's forward passes; decode s/token =
the generated tokens' steps. Wall seconds cover the whole process (imports, opening the
checkpoint, planning) and are reported separately.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import jsonio
from ..checkpoint.config import ModelConfig
from ..errors import Dsv4Error, UsageError
from . import simulate as sim

GB = 1_000_000_000
GENERATOR_KEY = "dsv4stream_generator"  # where synth records how a checkpoint was made
DSV4 = (sys.executable, "-c", "from dsv4stream.cli import main; main()")


@dataclass(frozen=True)
class BudgetRun:
    """One `dsv4 run` at one budget: its stats JSON, its route log, the kernel's peak RSS."""

    budget_gb: float
    stats: dict
    route_log: Path
    os_peak_rss_bytes: int
    wall_seconds: float


def generator_info(cfg: ModelConfig) -> dict | None:
    """synth's record of how a generated checkpoint was made (None for a real one)."""
    gen = cfg.raw.get(GENERATOR_KEY)
    return gen if isinstance(gen, dict) else None


def routing_kind(cfg: ModelConfig) -> str:
    """How the checkpoint routes, in words for the report."""
    gen = generator_info(cfg)
    if gen is None:
        return "the checkpoint's own routing (not a generated checkpoint, or its generator left no record)"
    skew = float(gen.get("route_skew") or 0.0)
    if skew == 0.0:
        return "generated, uniform routing (route_skew 0): caches look worse than with a trained model"
    return f"generated, skewed routing (route_skew {skew:g}: power-law expert popularity)"


def run_budget(
    checkpoint: Path,
    budget_gb: float,
    prompt_args: Sequence[str],
    gen: int,
    out_dir: Path,
    dsv4: Sequence[str] | None = None,
    extra: Sequence[str] = (),
) -> BudgetRun:
    """`dsv4 run` at one budget in a child process; its output goes to out_dir/run.log.
    ``dsv4``: the command that runs the CLI (default ``DSV4``, this interpreter)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stats_path, route_path, log_path = out_dir / "stats.json", out_dir / "route.log", out_dir / "run.log"
    for p in (stats_path, route_path):
        p.unlink(missing_ok=True)
    cmd = [*(DSV4 if dsv4 is None else dsv4), "run", str(checkpoint), *prompt_args, "--gen", str(gen), "--greedy"]
    cmd += ["--budget", f"{budget_gb:g}", "--io", "direct", "--stats-json", str(stats_path)]
    cmd += ["--route-log", str(route_path), *extra]
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env())
        proc.wait()
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not stats_path.exists():
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
        raise Dsv4Error(
            f"dsv4 run at --budget {budget_gb:g} failed (exit {proc.returncode}): {tail[0] if tail else 'no output'}"
            f" — see {log_path}"
        )
    stats = jsonio.read_json(stats_path, "the run's --stats-json", Dsv4Error, fix="run the sweep again")
    # The child's own high-water mark (VmHWM), which it reports: wait4's ru_maxrss would keep
    # this (parent) process's peak across the child's fork + exec.
    return BudgetRun(budget_gb, stats, route_path, int(stats.get("peak_rss_bytes") or 0), wall)


def _child_env() -> dict[str, str]:
    """This environment, with this copy of dsv4stream first on the child's path."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])  # the checkout holding dsv4stream/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def _stat(stats: dict, *names: str, default=None):
    """A figure from the stats JSON, flat or under "store" (StoreStats' names)."""
    for name in names:
        for d in (stats, stats.get("store") or {}):
            if d.get(name) is not None:
                return d[name]
    return default


def record(run: BudgetRun, hash_layers: int) -> dict:
    """One row of the sweep, with the route-log replay at the run's own cache size."""
    s = run.stats
    requests = _stat(s, "expert_requests", "requests", default=0)
    hits = _stat(s, "expert_hits", "hits", default=0)
    slots = _stat(s, "cache_slots", "slots")
    prompt_tokens = _stat(s, "prompt_tokens")
    if prompt_tokens is None and s.get("prompt_ids") is not None:
        prompt_tokens = len(s["prompt_ids"])
    prefill_s = _stat(s, "prefill_seconds")
    budget = _stat(s, "budget_bytes", default=round(run.budget_gb * GB))
    rec = {
        "budget_gb": run.budget_gb,
        "cache_slots": slots,
        "working_set_experts": _stat(s, "working_set_experts"),
        "expert_requests": requests,
        "expert_hits": hits,
        "expert_misses": _stat(s, "expert_misses", "misses", default=requests - hits),
        "hit_rate": hits / requests if requests else 0.0,
        "bytes_read": _stat(s, "bytes_read", default=0),
        "read_gbps": _stat(s, "read_gbps"),
        "read_seconds": _stat(s, "read_seconds"),
        "exposed_io_seconds": _stat(s, "exposed_io_seconds", "io_wait_seconds", "wait_seconds"),
        "trunk_streamed_layers": _stat(s, "trunk_streamed_layers"),
        "trunk_bytes_read": _stat(s, "trunk_bytes_read"),
        "prompt_tokens": prompt_tokens,
        "prefill_seconds": prefill_s,
        "prefill_tok_s": prompt_tokens / prefill_s if prompt_tokens and prefill_s else None,
        "decode_s_per_token": _stat(s, "decode_seconds_per_token"),
        "generated_tokens": len(s.get("generated_ids") or ()),
        "peak_rss_bytes": _stat(s, "peak_rss_bytes"),
        "os_peak_rss_bytes": run.os_peak_rss_bytes,
        "rss_over_budget": run.os_peak_rss_bytes / budget if budget else None,
        "io_mode": _stat(s, "io_mode", "io"),
        "wall_seconds": run.wall_seconds,
    }
    log = sim.read_route_log(run.route_log) if run.route_log.exists() else None
    if log is not None and len(log) and slots:
        rec["replay_lru_hits"] = sim.replay_store(log, int(slots), hash_layers).hits
        rec["replay_matches"] = rec["replay_lru_hits"] == hits and len(log) == requests
        rec["replay_belady_hits"] = sim.belady(sim.key_ids(log).tolist(), int(slots)).hits
    return rec


def check_same_ids(runs: Sequence[BudgetRun]) -> list[int]:
    """The common generated ids; a Dsv4Error naming the first difference otherwise."""
    ref = runs[0].stats.get("generated_ids")
    if ref is None:
        raise Dsv4Error("dsv4 run's stats JSON has no generated_ids; cannot check that budgets agree")
    for r in runs[1:]:
        ids = r.stats.get("generated_ids")
        if ids != ref:
            n = min(len(ids or ()), len(ref))
            at = next((i for i in range(n) if ids[i] != ref[i]), n)
            got = ids[at] if ids and at < len(ids) else "end"
            want = ref[at] if at < len(ref) else "end"
            raise Dsv4Error(
                f"token ids differ between --budget {runs[0].budget_gb:g} and --budget {r.budget_gb:g} at generated"
                f" token {at} ({want} vs {got}): results depend on the budget, a bug; rerun with --verify and report it"
            )
    return list(ref)


def sweep(
    checkpoint: Path,
    budgets: Sequence[float],
    prompt_args: Sequence[str],
    gen: int,
    out_dir: Path,
    *,
    dsv4: Sequence[str] | None = None,
    extra: Sequence[str] = (),
    progress: Callable[[str], None] = lambda m: None,
) -> tuple[list[dict], dict]:
    """Run every budget (ascending), check the ids agree; (records, metadata)."""
    if not budgets:
        raise UsageError("--budgets needs at least one budget")
    cfg = ModelConfig.from_json(checkpoint / "config.json")
    hash_layers = min(cfg.num_hash_layers, cfg.n_layers)
    runs, records = [], []
    for gb in sorted(budgets):
        progress(f"--budget {gb:g}: running ...")
        run = run_budget(checkpoint, gb, prompt_args, gen, out_dir / f"budget-{gb:g}", dsv4, extra)
        runs.append(run)
        records.append(rec := record(run, hash_layers))
        progress(
            f"--budget {gb:g}: hit rate {100 * rec['hit_rate']:.1f}%, {rec['bytes_read'] / GB:.2f} GB read,"
            f" peak RSS {run.os_peak_rss_bytes / GB:.2f} GB, {run.wall_seconds:.1f} s"
        )
    ids = check_same_ids(runs)
    meta = {
        "checkpoint": str(checkpoint),
        "routing": routing_kind(cfg),
        "generator": generator_info(cfg),
        "prompt_args": list(prompt_args),
        "gen": gen,
        "generated_ids": ids,
        "working_set_experts": cfg.working_set_experts,
        "expert_bytes": cfg.expert_bytes,
        "hash_layers": hash_layers,
        "machine": machine(),
    }
    return records, meta


def machine() -> dict:
    """What the figures were measured on."""
    import platform

    import psutil

    return {
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
    }
