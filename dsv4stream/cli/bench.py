"""`dsv4 bench`: the live budget sweep (`dsv4 bench CHECKPOINT ...`, i.e. `bench run`) and
the what-if replay of a route log (`dsv4 bench simulate ROUTE_LOG ...`).

Owns the command line, the budget -> expert-slot conversion (through the planner), the
table and the CSV / JSON / PNG outputs. The policies live in `dsv4stream.measure.simulate`, the
figure in `dsv4stream.measure.benchplot`.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

import click

from ..checkpoint.config import ModelConfig
from ..engine.numerics import RUN_DEFAULT
from ..errors import UsageError
from ..files import AtomicFile, atomic_write
from ..measure import simulate as sim
from ..run.planner import GB, MemoryNeeds, plan, smallest_budget
from .numerics_option import numerics_option
from .outputs import check_output, check_output_dir
from .registry import check_not_a_typo


class DefaultToRun(click.Group):
    """A group whose unknown first word (a checkpoint path) is `run`'s argument, so
    `dsv4 bench CHECKPOINT ...` means `dsv4 bench run CHECKPOINT ...`."""

    default_command = "run"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            check_not_a_typo(args[0], sorted(self.commands), "dsv4 bench")
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


@click.group("bench", cls=DefaultToRun, context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Cache benchmarks. `dsv4 bench CHECKPOINT --budgets 1,2,4 --gen N` runs the live
    sweep; `dsv4 bench simulate ROUTE_LOG` replays a route log through cache policies."""


# ---- the live sweep ----------------------------------------------------------------------


DEFAULT_PROMPT = "Explain in three sentences why a cache smaller than its working set never hits."


@bench.command("run")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--budgets", default="1,2,4,8", show_default=True, help="Comma-separated --budget values, GB.")
@click.option("--prompt", default=None, help="Prompt text (default: a fixed sentence).")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option("--prompt-ids", default=None, help="Comma-separated token ids instead of text.")
@click.option("--gen", type=int, default=16, show_default=True, help="Tokens to generate at each budget.")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-out"),
    show_default=True,
    help="Writes bench.csv, bench.json, bench.png and one folder per budget.",
)
@click.option("--run-arg", "run_args", multiple=True, help="Extra option for each `dsv4 run` (repeatable).")
@numerics_option(RUN_DEFAULT, " Passed to each `dsv4 run`.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def run_sweep(
    checkpoint: Path,
    budgets: str,
    prompt: str | None,
    prompt_file: Path | None,
    prompt_ids: str | None,
    gen: int,
    out_dir: Path,
    run_args: tuple[str, ...],
    numerics: str,
    debug: bool,
) -> None:
    """Run the same greedy generation at each budget, each in a fresh process from a cold
    cache with direct I/O, and record hit rate, bytes read, read GB/s, exposed I/O,
    prefill tok/s, decode s/token and peak RSS. Fails if the token ids differ."""
    from ..measure import sweep as sw

    if sum(x is not None for x in (prompt, prompt_file, prompt_ids)) > 1:
        raise UsageError("give at most one of --prompt, --prompt-file, --prompt-ids")
    if gen < 1:
        raise UsageError(f"--gen must be at least 1, found {gen}")
    if prompt_ids is not None:
        prompt_args = ["--prompt-ids", prompt_ids]
    else:
        text = prompt_file.read_text(encoding="utf-8") if prompt_file is not None else prompt or DEFAULT_PROMPT
        prompt_args = ["--prompt", text]
    gbs = parse_list(budgets, float, "--budgets")
    check_output_dir(out_dir, "--out", ("bench.csv", "bench.json", "bench.png"))
    cfg = load_config(checkpoint)
    click.echo(f"{checkpoint}: {sw.routing_kind(cfg)}")
    records, meta = sw.sweep(
        checkpoint,
        gbs,
        prompt_args,
        gen,
        out_dir,
        extra=("--numerics", numerics, *run_args),
        progress=lambda m: click.echo(m, err=True),
    )
    ws_budget = working_set_budget(memory_needs(checkpoint)[0])
    meta["working_set_budget_gb"] = ws_budget / GB if ws_budget is not None else None
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(out_dir / "bench.csv", records)
    atomic_write(out_dir / "bench.json", json.dumps({**meta, "results": records}, indent=1) + "\n")
    from ..measure.benchplot import plot_sweep

    plot_sweep(records, out_dir / "bench.png", threshold=meta["working_set_budget_gb"], title=sweep_title(meta, gen))
    for line in sweep_table(records):
        click.echo(line)
    click.echo(REPLAY_NOTE)
    for line in below_working_set(records, meta["working_set_budget_gb"]):
        click.echo(line, err=True)
    click.echo(f"token ids identical at every budget ({len(meta['generated_ids'])} generated)")
    bad = [r["budget_gb"] for r in records if r.get("replay_matches") is False]
    if bad:
        click.echo(f"warning: replaying the route log did not reproduce the LRU hits at --budget {bad}", err=True)
    click.echo(f"note: real hit rates depend on the real model's routing; this ran on {sw.routing_kind(cfg)}")
    click.echo(f"wrote {out_dir / 'bench.csv'}, {out_dir / 'bench.json'}, {out_dir / 'bench.png'}")


REPLAY_NOTE = (
    "replay: '=' when replaying the run's route log through the store's LRU gives exactly its hits"
    " (the simulator is trustworthy for `dsv4 bench simulate`), 'DIFF' when not, '-' without a log"
)


def sweep_title(meta: dict, gen: int) -> str:
    """What the plot shows, on what: model shape, routing, run length, machine."""
    ws, mach = meta.get("working_set_experts"), meta.get("machine") or {}
    routing = str(meta.get("routing", "")).split(":")[0]
    return (
        f"hit rate and decode speed by --budget: {Path(meta['checkpoint']).name}, {routing}\n"
        f"{gen} greedy tokens per budget, cold cache, working set {ws} experts, {mach.get('cpus', '?')} CPUs"
    )


def below_working_set(records: Sequence[dict], ws_budget_gb: float | None) -> list[str]:
    """The runs' own warning, in the summary: budgets whose cache holds less than one pass."""
    out = []
    for r in records:
        ws, slots = r.get("working_set_experts"), r.get("cache_slots")
        if ws and slots is not None and slots < ws:
            more = f"; from --budget {ws_budget_gb:.2f} up it holds one pass" if ws_budget_gb else ""
            out.append(
                f"warning: at --budget {r['budget_gb']:g} the cache holds {slots} experts, fewer than the"
                f" working set of {ws}: LRU evicts nearly every expert before reuse (hit rate near 0){more}"
            )
    return out


def sweep_table(records: Sequence[dict]) -> list[str]:
    """The live sweep as printed: one row per budget."""

    def f(v, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    head = f"{'budget':>7} {'slots':>6} {'hit rate':>8} {'replay':>6} {'GB read':>8} {'GB/s':>6} {'exposed s':>9}"
    out = [head + f" {'prefill t/s':>11} {'s/token':>8} {'peak RSS GB':>11}"]
    for r in records:
        replay = {True: "=", False: "DIFF"}.get(r.get("replay_matches"), "-")
        out.append(
            f"{r['budget_gb']:>5g}GB {f(r['cache_slots'], '>6')} {100 * r['hit_rate']:>7.1f}% {replay:>6}"
            f" {r['bytes_read'] / GB:>8.2f} {f(r['read_gbps'], '>6.2f')} {f(r['exposed_io_seconds'], '>9.2f')}"
            f" {f(r['prefill_tok_s'], '>11.2f')} {f(r['decode_s_per_token'], '>8.3f')}"
            f" {r['os_peak_rss_bytes'] / GB:>11.2f}"
        )
    return out


# ---- the replay ----------------------------------------------------------------------------


def parse_list(text: str, kind: type, what: str) -> list:
    """'1,2,4' -> [1, 2, 4]; a one-line UsageError naming the option otherwise."""
    try:
        vals = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{what} takes comma-separated numbers, found {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise UsageError(f"{what} needs positive numbers, found {text!r}")
    return vals


def load_config(path: Path) -> ModelConfig:
    """A checkpoint directory or a config.json file."""
    return ModelConfig.from_json(path / "config.json" if path.is_dir() else path)


def memory_needs(path: Path) -> tuple[MemoryNeeds, str]:
    """What the planner places for this model (`memory.needs_of`: as `dsv4 run` plans it)."""
    from ..run.memory import needs_of

    return needs_of(path)


def budget_slots(needs: MemoryNeeds, budget_gb: float) -> int:
    """Expert slots the planner gives a `--budget budget_gb` run (BudgetError below the minimum)."""
    return plan(needs, round(budget_gb * GB)).expert_slots


def working_set_budget(needs: MemoryNeeds) -> int | None:
    """Smallest budget (bytes) whose plan holds one pass's working set; None if none does."""
    want = min(needs.working_set, needs.total_experts)
    return smallest_budget(needs, lambda p: p.expert_slots >= want)


@bench.command("simulate")
@click.argument("route_log", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--cache-experts", default=None, help="Comma-separated cache sizes in experts (slots).")
@click.option("--budgets", default=None, help="Comma-separated --budget values in GB; needs --config.")
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="Checkpoint directory or config.json: expert bytes, hash layers, budget -> slots.",
)
@click.option("--policies", default=",".join(sim.POLICIES), show_default=True)
@click.option(
    "--hints",
    type=click.Choice(["engine", "none"]),
    default="engine",
    show_default=True,
    help="LRU with the engine's prefetch hints (as a live run) or plain LRU on the requests.",
)
@click.option(
    "--hash-layers", type=int, default=None, help="Hash-routed layers (default: the config's; needed without --config)."
)
@click.option("--lru-share", type=float, default=0.5, show_default=True, help="Part of the slots pinned+lru runs LRU.")
@click.option("--expert-bytes", type=int, default=None, help="Bytes per expert (default: from --config).")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="PNG.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def simulate_cmd(
    route_log: Path,
    cache_experts: str | None,
    budgets: str | None,
    config_path: Path | None,
    policies: str,
    hints: str,
    hash_layers: int | None,
    lru_share: float,
    expert_bytes: int | None,
    csv_path: Path | None,
    json_path: Path | None,
    plot_path: Path | None,
    debug: bool,
) -> None:
    """Replay ROUTE_LOG (written by `dsv4 run --route-log`) through LRU, frequency-pinned and
    Belady's optimal cache at several sizes; print hit rates and the bytes each would read."""
    for flag, p in (("--csv", csv_path), ("--json", json_path), ("--plot", plot_path)):
        check_output(p, flag)
    if (cache_experts is None) == (budgets is None):
        raise UsageError("give the cache sizes with exactly one of --cache-experts N,N,... or --budgets GB,GB,...")
    cfg = load_config(config_path) if config_path is not None else None
    if budgets is not None and cfg is None:
        raise UsageError("--budgets needs --config CHECKPOINT (or its config.json) to turn GB into expert slots")
    if not 0.0 < lru_share <= 1.0:
        raise UsageError(f"--lru-share must be in (0, 1], found {lru_share}")
    log = sim.read_route_log(route_log)
    if cfg is not None:
        _check_log_fits(log, cfg, route_log)
    if hash_layers is None and cfg is None and hints == "engine":
        # the engine prefetches the hash layers' experts: a wrong count moves hits (never guess it)
        raise UsageError(
            "the replay needs the model's hash layers: give --config CHECKPOINT (or its config.json),"
            " or --hash-layers N, or --hints none for plain LRU"
        )
    if hash_layers is None:
        hash_layers = min(cfg.num_hash_layers, cfg.n_layers) if cfg is not None else 0
    if expert_bytes is None:
        expert_bytes = cfg.expert_bytes if cfg is not None else 0
    pols = [p.strip() for p in policies.split(",") if p.strip()]

    needs, needs_source = memory_needs(config_path) if budgets is not None else (None, "")
    if budgets is not None:
        gbs = parse_list(budgets, float, "--budgets")
        sizes = [budget_slots(needs, gb) for gb in gbs]
    else:
        gbs = None
        sizes = parse_list(cache_experts, int, "--cache-experts")
    results = sim.simulate(log, sizes, pols, expert_bytes, hints, hash_layers, lru_share)
    records = []
    for i, r in enumerate(results):
        rec = r.as_dict()
        if gbs is not None:
            rec["budget_gb"] = gbs[i // len(pols)]
        records.append(rec)

    working_set = cfg.working_set_experts if cfg is not None else None
    for line in _summary(route_log, log, hints, hash_layers, expert_bytes, working_set):
        click.echo(line)
    if budgets is not None:
        click.echo(f"budgets -> slots: the planner's split, sizes {needs_source}")
    for line in format_table(records, bytes_known=expert_bytes > 0):
        click.echo(line)
    if working_set is not None and min(sizes) < working_set:
        click.echo(
            f"note: below {working_set} slots (one pass's working set) LRU evicts nearly every expert before its"
            " layer comes round again; pinned and Belady keep some."
        )
    click.echo(
        "note: hit rates depend on the routing in the log; a generated checkpoint's routing is not a trained model's."
    )
    meta = {
        "route_log": str(route_log),
        "requests": len(log),
        "passes": sim.forward_passes(log),
        "distinct_experts": sim.distinct(log),
        "hints": hints,
        "hash_layers": hash_layers,
        "expert_bytes": expert_bytes,
        "working_set_experts": working_set,
        "lru_share": lru_share,
    }
    if csv_path is not None:
        write_csv(csv_path, records)
    if json_path is not None:
        atomic_write(json_path, json.dumps({**meta, "results": records}, indent=1) + "\n")
    if plot_path is not None:
        from ..measure.benchplot import plot_sweep

        x = "budget_gb" if gbs is not None else "slots"
        threshold = None
        if working_set is not None:
            if gbs is None:
                threshold = working_set
            else:
                b = working_set_budget(needs)
                threshold = b / GB if b is not None else None
        title = (
            f"hit rate by policy and cache size: replay of {route_log.name}\n"
            f"{len(log):,} requests in {sim.forward_passes(log):,} passes, hints {hints}, {hash_layers} hash layers"
        )
        plot_sweep(records, plot_path, x=x, threshold=threshold, title=title)
    for p in (csv_path, json_path, plot_path):
        if p is not None:
            click.echo(f"wrote {p}")


def _check_log_fits(log, cfg: ModelConfig, path: Path) -> None:
    if not len(log):
        return
    layers, experts = int(log[:, 0].max()), int(log[:, 1].max())
    if experts >= cfg.n_routed_experts or layers >= cfg.n_layers + cfg.n_mtp:
        raise UsageError(
            f"{path}: requests layer {layers} expert {experts}, but the config has {cfg.n_layers + cfg.n_mtp} layers"
            f" of {cfg.n_routed_experts} experts; pass the config of the model that wrote the log"
        )


def _summary(path: Path, log, hints: str, hash_layers: int, expert_bytes: int, working_set: int | None) -> list[str]:
    passes = sim.forward_passes(log)
    line = f"{path}: {len(log):,} requests in {passes:,} forward passes, {sim.distinct(log):,} distinct experts" + (
        f"; working set {working_set} experts per pass" if working_set else ""
    )
    how = (
        f"LRU with the engine's prefetch hints ({hash_layers} hash layer{'s' if hash_layers != 1 else ''})"
        if hints == "engine"
        else "plain LRU on requests"
    )
    size = f"{expert_bytes:,} bytes per expert" if expert_bytes else "expert size unknown (give --config)"
    return [line, f"{how}; cold start; {size}"]


def format_table(records: Sequence[dict], bytes_known: bool = True) -> list[str]:
    """The printed table: one row per (size, policy)."""
    has_budget = any("budget_gb" in r for r in records)
    head = (f"{'budget':>8} " if has_budget else "") + f"{'slots':>7}  {'policy':<11}{'hit rate':>9}{'hits':>12}"
    head += f"{'misses':>12}" + (f"{'read GB':>11}" if bytes_known else "")
    out = [head]
    for r in records:
        row = (f"{r['budget_gb']:>6g} GB " if has_budget else "") + f"{r['slots']:>7}  {r['policy']:<11}"
        row += f"{100 * r['hit_rate']:>8.1f}%{r['hits']:>12,}{r['misses']:>12,}"
        row += f"{r['bytes_read'] / GB:>11.2f}" if bytes_known else ""
        out.append(row)
    return out


def write_csv(path: Path, records: Sequence[dict]) -> None:
    fields = list(dict.fromkeys(k for r in records for k in r))
    with AtomicFile(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f.file, fieldnames=fields)
        w.writeheader()
        w.writerows(records)
