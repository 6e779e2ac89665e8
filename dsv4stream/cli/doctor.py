"""`dsv4 doctor`: measure this machine and say what budget to use. Exits 0 once it measures; a bad
option is one `dsv4:` line, exit 2."""

from __future__ import annotations

from pathlib import Path

import click
import psutil

from ..checkpoint.config import ModelConfig
from ..errors import Dsv4Error, UsageError
from ..measure import doctor as d
from ..run.memory import needs_of

ENGRAM_DEPTHS = (8, 32)  # a token's ~96 Engram page reads are issued together


@click.command("doctor")
@click.argument("target", required=False, type=click.Path(path_type=Path), default=".")
@click.option("--seconds", type=str, default="1", show_default=True, help="Read time per queue depth.")
@click.option("--depths", default="1,2,4", show_default=True, help="Queue depths (reader threads) to try.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def doctor(target: Path, seconds: str, depths: str, debug: bool) -> None:
    """Measure read bandwidth, memory and VRAM; recommend a --budget for TARGET's model.

    The budgets come from the same planner `dsv4 run` and `dsv4 inspect` use, measured on
    the checkpoint when TARGET is one.

    TARGET is a checkpoint directory (its largest shard is read) or any directory on the
    drive you will keep the checkpoint on (a temporary 512 MB file is written and removed).
    """
    secs, qd = check_seconds(seconds), parse_depths(depths)
    for line in d.memory_lines():
        click.echo(line)
    click.echo(d.vram_line())
    click.echo(numerics_line())
    cfg = None
    if target.is_dir() and (target / "config.json").is_file():
        try:
            cfg = ModelConfig.from_json(target / "config.json")
        except Dsv4Error as e:
            click.echo(f"config: {e}")
    block = max(cfg.expert_bytes, 1 << 20) if cfg else 13_369_344  # tiny test experts: 1 MiB reads
    if target.exists():
        try:
            probe = d.ProbeFile(target)
        except OSError as e:
            click.echo(
                f"read bandwidth: cannot write a probe file in {target} ({e.strerror}); pass a checkpoint directory"
            )
        else:
            with probe:
                for f in d.read_bandwidth(probe.path, block, qd, secs):
                    mode = "O_DIRECT" if f.direct else "buffered (O_DIRECT refused)"
                    click.echo(
                        f"read bandwidth: {f.gbps:.2f} GB/s at queue depth {f.depth}, {f.block:,}-byte reads,"
                        f" {mode}, {probe.label}"
                    )
                if cfg is not None and cfg.engram is not None:  # V4.1: its Engram rows are 4 KiB random reads
                    line = d.engram_read_line(cfg, d.read_bandwidth(probe.path, 4096, ENGRAM_DEPTHS, secs))
                    click.echo(line)
    else:
        click.echo(f"read bandwidth: {target} does not exist; pass the checkpoint directory")
    if cfg is None:
        click.echo(f"no config.json in {target}: advice below is for the released V4-Flash config")
        source = Path(__file__).resolve().parents[1] / "v4_flash_config.json"
        cfg = ModelConfig.from_json(source)
    else:
        source = target
    needs, how = needs_of(source)
    click.echo(f"sizes {how}")
    for line in d.advice_lines(cfg, needs, psutil.virtual_memory().available):
        click.echo(line)


MAX_SECONDS = 600.0  # per queue depth: a measurement, not a soak
MAX_DEPTH = 64  # reader threads; the store uses a handful


def check_seconds(text: str) -> float:
    """--seconds: a finite number of seconds in (0, MAX_SECONDS]; nan, inf and negatives are refused."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= MAX_SECONDS:  # also false for nan
        raise UsageError(
            f"--seconds {text}: give a number of seconds above 0 and at most {MAX_SECONDS:g}, like 1 or 2.5"
        )
    return v


def parse_depths(text: str) -> tuple[int, ...]:
    """--depths: comma-separated queue depths, each 1..MAX_DEPTH."""
    parts = [p.strip() for p in text.split(",")]
    try:
        qd = tuple(int(p) for p in parts)
    except ValueError:
        qd = ()
    if not qd or any(not 1 <= q <= MAX_DEPTH for q in qd):
        raise UsageError(f"--depths {text}: give queue depths from 1 to {MAX_DEPTH}, comma-separated, like 1,2,4")
    return qd


def numerics_line() -> str:
    """What `--numerics fast` runs on this CPU (the variant per weight kind, `kernels.cpu`)."""
    from ..engine.numerics import label
    from ..kernels import cpu

    return f"numerics: --numerics fast runs {label('fast')}; {cpu.describe()}"
