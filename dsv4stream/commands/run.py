"""`dsv4 run`: generate from a checkpoint within `--budget`; the work is in `dsv4stream.runtime`.

Owns: option parsing, choosing the prompt (ids, or text through the tokenizer), where things
are printed (the plan and the figures on stderr, the generated text or ids on stdout) and
the stats JSON. Greedy decoding; sampling options come with the chat front end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import numpy as np

from ..commands.logits import parse_tokens
from ..errors import TokenizerError, UsageError
from ..runtime import RunOptions, Runtime, budget_bytes, checkpoint_path
from ..tokenizer import Tokenizer, default_pack_path


def load_tokenizer(checkpoint: Path, tok: Path | None) -> Tokenizer:
    """--tok FILE, else the checkpoint's packed tokenizer, else its tokenizer files."""
    if tok is not None:
        return Tokenizer.load(tok)
    if default_pack_path(checkpoint).is_file():
        return Tokenizer.load(default_pack_path(checkpoint))
    return Tokenizer.from_checkpoint(checkpoint)


def text_prompt(tok: Tokenizer, text: str, vocab_size: int) -> list[int]:
    """BOS + the text's ids (a raw completion prompt, no chat template)."""
    if tok.vocab_size != vocab_size:
        raise TokenizerError(
            f"{tok.path or 'tokenizer'}: vocabulary of {tok.vocab_size} tokens, the model has {vocab_size};"
            " pass the tokenizer of this checkpoint with --tok"
        )
    return [tok.special.bos, *tok.encode(text)]


def masked_greedy(n_tokens: int):
    """Greedy over the ids the tokenizer can print (the embedding may have padding rows)."""
    return lambda logits: int(np.argmax(logits[:n_tokens]))


@click.command("run")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--prompt-ids", help="Prompt as token ids: 1,2,3.")
@click.option("--prompt", help="Prompt text (tokenized with the checkpoint's tokenizer, BOS added).")
@click.option("--gen", "gen", type=int, default=32, show_default=True, help="Tokens to generate.")
@click.option("--greedy", is_flag=True, help="Greedy decoding (the default for now).")
@click.option(
    "--budget",
    type=float,
    default=None,
    help="GB (10^9 bytes) the whole process may hold. [default: 80% of available memory]",
)
@click.option(
    "--verify", is_flag=True, help="Re-read every expert and streamed layer with plain pread and compare bytes."
)
@click.option(
    "--io",
    type=click.Choice(["direct", "buffered"]),
    default="direct",
    show_default=True,
    help="O_DIRECT reads or the page cache.",
)
@click.option("--io-threads", type=int, default=4, show_default=True, help="Expert reader threads (queue depth).")
@click.option("--stats-json", type=click.Path(path_type=Path, dir_okay=False), help="Write the run's figures as JSON.")
@click.option(
    "--route-log",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write one 'layer expert' line per expert request.",
)
@click.option("--threads", type=int, default=None, help="Kernel threads (results do not depend on it).")
@click.option(
    "--trunk",
    type=click.Path(path_type=Path, file_okay=False),
    help="Packed trunk directory. [default: CHECKPOINT/dsv4-trunk if packed, else the shards]",
)
@click.option(
    "--tok",
    type=click.Path(path_type=Path),
    help="Packed tokenizer. [default: CHECKPOINT/dsv4-tokenizer.pack, else the checkpoint's tokenizer files]",
)
@click.option("--ctx", type=int, default=4096, show_default=True, help="Longest sequence the memory plan covers.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def run(
    checkpoint: Path,
    prompt_ids: str | None,
    prompt: str | None,
    gen: int,
    greedy: bool,
    budget: float | None,
    verify: bool,
    io: str,
    io_threads: int,
    stats_json: Path | None,
    route_log: Path | None,
    threads: int | None,
    trunk: Path | None,
    tok: Path | None,
    ctx: int,
    debug: bool,
) -> None:
    """Generate from CHECKPOINT with routed experts streamed from disk within --budget."""
    checkpoint = checkpoint_path(checkpoint)
    if (prompt_ids is None) == (prompt is None):
        raise UsageError("give exactly one of --prompt-ids 1,2,3 or --prompt TEXT")
    if gen < 1:
        raise UsageError(f"--gen {gen}: generate at least one token")
    opts = RunOptions(
        budget=budget_bytes(budget), io=io, verify=verify, threads=threads, io_threads=io_threads,
        trunk=trunk, route_log=route_log, ctx=ctx,
    )  # fmt: skip
    say = lambda msg: click.echo(msg, err=True)
    with Runtime.open(checkpoint, opts, warn=lambda m: say(f"dsv4: {m}")) as rt:
        plan_lines = rt.plan.lines()
        for line in plan_lines:
            say(line)
        if prompt is not None:
            tokenizer = load_tokenizer(checkpoint, tok)
            ids = text_prompt(tokenizer, prompt, rt.cfg.vocab_size)
            pick, stop = masked_greedy(tokenizer.n_tokens), (tokenizer.special.eos,)
        else:
            tokenizer, ids = None, [int(i) for i in parse_tokens(prompt_ids, None)]
            pick, stop = None, ()
        if len(ids) + gen > ctx:
            raise UsageError(f"prompt ({len(ids)} tokens) + --gen {gen} exceeds --ctx {ctx}; raise --ctx")
        session = rt.session()
        out = []
        stream = tokenizer.stream() if tokenizer is not None else None
        for t in rt.generate(session, ids, gen, pick, stop):
            out.append(t)
            if stream is not None:
                click.echo(stream.push(t), nl=False)
                sys.stdout.flush()
        if stream is not None:
            click.echo(stream.flush())
        else:
            click.echo(",".join(str(t) for t in out))
        stats = rt.stats()
        for line in stats.lines():
            if line not in plan_lines:  # the plan's warnings were said at the start
                say(line)
        if stats_json is not None:
            stats_json.write_text(json.dumps(stats.as_dict(), indent=1) + "\n")
