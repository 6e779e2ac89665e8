"""`dsv4 perplexity CHECKPOINT --text FILE`: perplexity of a text, and what one numerics costs
against another (mean / p99 KL divergence, top-1 agreement), as llama.cpp's
`llama-perplexity --kl-divergence` reports them.

The text is tokenized with the checkpoint's tokenizer and cut into windows of --ctx tokens;
each window starts a fresh sequence with BOS and every text token of it is scored (predicted
from the tokens before it in the window). The base numerics (--kl-base, default exact) runs
first and keeps a bounded record per position (`measure.perplexity`: top 64 log-probs), then
the tested numerics (--numerics, default fast) runs the same windows; each run opens the model
afresh (the numerics is per process and per engine) within --budget as `dsv4 run` does.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import click
import numpy as np

from ..checkpoint.config import ModelConfig
from ..engine.numerics import CHOICES, RUN_DEFAULT, canonical
from ..errors import UsageError
from ..files import atomic_write
from ..measure import perplexity as ppl
from ..run.runinfo import RunOptions
from ..run.runtime import Runtime
from .budget import budget_bytes
from .numerics_option import numerics_option
from .outputs import check_output
from .run import checkpoint_dir, load_tokenizer

SEGMENT = 256  # tokens per prefill call: the logits held at once are SEGMENT x vocab


def windows(ids: list[int], ctx: int, bos: int) -> list[np.ndarray]:
    """The text ids in windows of at most ctx tokens, BOS first: each window's text tokens are
    ctx - 1 at most (the last window may be shorter)."""
    step = ctx - 1
    return [np.array([bos, *ids[a : a + step]], dtype=np.int64) for a in range(0, len(ids), step)]


def run_windows(rt: Runtime, wins: list[np.ndarray], keep) -> list:
    """Feed each window (all but its last token) and hand each segment's logits and next tokens to keep."""
    out = []
    for w in wins:
        session = rt.session()
        feed, targets = w[:-1], w[1:]
        for a in range(0, feed.size, SEGMENT):
            logits = session.prefill(feed[a : a + SEGMENT])
            out.append(keep(logits, targets[a : a + SEGMENT]))
    return out


@click.command("perplexity")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--text", "text_path", required=True, type=click.Path(path_type=Path), help="UTF-8 text file to score.")
@numerics_option(RUN_DEFAULT, " The numerics tested.")
@click.option(
    "--kl-base",
    type=click.Choice(CHOICES),
    default="exact",
    show_default=True,
    help="The numerics the KL divergence and top-1 agreement are measured against.",
)
@click.option("--ctx", type=int, default=512, show_default=True, help="Tokens per window (BOS included).")
@click.option("--budget", type=float, default=None, help="GB of RAM the run may use (as `dsv4 run`). [default: as run]")
@click.option("-t", "--threads", type=int, default=None, help="CPU kernel threads (results do not depend on it).")
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write all figures."
)
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def perplexity(
    checkpoint: Path,
    text_path: Path,
    numerics: str,
    kl_base: str,
    ctx: int,
    budget: float | None,
    threads: int | None,
    json_path: Path | None,
    debug: bool,
) -> None:
    """Perplexity of --text under --numerics, and its KL divergence from --kl-base."""
    checkpoint = checkpoint_dir(checkpoint)
    check_output(json_path, "--json")
    if ctx < 2:
        raise UsageError(f"--ctx {ctx}: give at least 2 (BOS and one token to score)")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads {threads}: give at least 1")
    if not text_path.is_file():
        raise UsageError(f"--text {text_path}: no such file; give a UTF-8 text file")
    try:
        text = text_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--text {text_path}: not UTF-8 (byte {e.start}); give a UTF-8 text file") from None
    if not text.strip():
        raise UsageError(f"--text {text_path}: the file holds no text; give a text to score")
    cfg = ModelConfig.from_json(checkpoint / "config.json")
    if ctx > cfg.max_position_embeddings:
        raise UsageError(f"--ctx {ctx}: the model reads at most {cfg.max_position_embeddings} positions")
    tok = load_tokenizer(checkpoint, None, cfg)
    ids = tok.encode_plain(text)
    if len(ids) < 2:
        raise UsageError(f"--text {text_path}: {len(ids)} token(s); give a text of at least 2 tokens")
    tested, base = canonical(numerics), canonical(kl_base)
    wins = windows(ids, ctx, tok.special.bos)
    say = lambda m: click.echo(m if m.startswith("dsv4:") else f"dsv4: {m}", err=True)
    opts = RunOptions(budget=budget_bytes(budget), threads=threads, ctx=ctx)

    def run(mode: str, keep) -> tuple[list, float, str]:
        t0 = time.perf_counter()
        with Runtime.open(checkpoint, replace(opts, numerics=mode), warn=say) as rt:
            parts = run_windows(rt, wins, keep)
            label = rt.stats().numerics
        return parts, time.perf_counter() - t0, label

    say(f"dsv4: {len(ids)} tokens in {len(wins)} window(s) of at most {ctx}; base {base}, tested {tested}")
    parts, base_s, base_label = run(base, ppl.record)
    rec = ppl.BaseRecord.concat(parts)
    at = [0]

    def against_base(logits: np.ndarray, targets: np.ndarray) -> ppl.Compared:
        a, at[0] = at[0], at[0] + targets.size
        return ppl.compare(
            ppl.BaseRecord(rec.nll[a : at[0]], rec.idx[a : at[0]], rec.logp[a : at[0]], rec.rest[a : at[0]]),
            logits,
            targets,
        )

    parts, test_s, test_label = run(tested, against_base)
    figures = ppl.summary(rec, ppl.Compared.concat(parts))
    for line in summary_lines(figures, base_label, test_label):
        click.echo(line)
    if json_path is not None:
        doc = {
            "checkpoint": str(checkpoint), "text": str(text_path), "tokens": len(ids), "ctx": ctx,
            "windows": len(wins), "numerics": test_label, "kl_base": base_label, "top_k": ppl.TOP_K,
            "seconds": {"base": base_s, "tested": test_s}, **figures,
        }  # fmt: skip
        atomic_write(json_path, json.dumps(doc, indent=1) + "\n")
        click.echo(f"wrote {json_path}")


def summary_lines(f: dict, base_label: str, test_label: str) -> list[str]:
    return [
        f"positions: {f['positions']}",
        f"perplexity: {f['perplexity']:.4f} ({test_label}); {f['base_perplexity']:.4f} ({base_label})",
        (
            f"KL({base_label} || {test_label}): mean {f['kl_mean']:.6g}, median {f['kl_median']:.6g},"
            f" p99 {f['kl_p99']:.6g}, max {f['kl_max']:.6g}"
        ),
        f"top-1 agreement: {f['top1_agreement']:.2%}; mean ln p difference {0.0 - f['mean_nll_difference']:+.6g}",
    ]
