"""`dsv4 logits`: teacher-forced logits for every position of a token sequence.

Writes float32 [T, vocab] to a .npy file. Useful for checking the forward pass against
another implementation and for scoring text. `--mode` picks how the tokens are fed:
one prefill chunk, one token at a time (a decode step per token), or chunks of N; all give
the same numbers up to float rounding (for V4.1 with `--index-keys owner`, the default).
`--numerics exact|official|fast` (`engine.numerics`; default the family's, V4 exact and V4.1
official, so checks against references stay as they were); DeepSeek-V4.1 checkpoints also take
`--index-keys owner|as-shipped` (`engine.stack_v41.V41Options`).
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import numpy as np

from ..engine.session import Engine
from ..engine.stack_v41 import V41Options
from ..errors import UsageError
from ..files import AtomicFile
from .numerics_option import numerics_option
from .outputs import check_output


def parse_tokens(tokens: str | None, tokens_file: Path | None) -> np.ndarray:
    """Comma/space-separated ids from --tokens, or from a text or .npy file."""
    if (tokens is None) == (tokens_file is None):
        raise UsageError("give exactly one of --tokens 1,2,3 or --tokens-file FILE")
    if tokens_file is not None:
        if tokens_file.suffix == ".npy":
            ids = np.load(tokens_file).reshape(-1)
            if not np.issubdtype(ids.dtype, np.integer):
                raise UsageError(f"{tokens_file}: expected an integer array, found {ids.dtype}")
            return ids.astype(np.int64)
        try:
            tokens = tokens_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{tokens_file}: cannot read it as a UTF-8 list of ids ({e})") from None
    text = tokens.strip()
    # ids separated by commas and/or spaces; an empty field (1,,2 or a trailing comma) is a typo
    parts = re.split(r"\s*,\s*|\s+", text) if text else []
    if "" in parts:
        raise UsageError(f"token list {tokens!r} has an empty entry; pass ids like 1,2,3")
    bad = next((p for p in parts if not re.fullmatch(r"-?[0-9]+", p)), None)
    if bad is not None:
        raise UsageError(f"token list: {bad!r} is not an integer id; pass ids like 1,2,3")
    big = next((p for p in parts if not -(2**63) <= int(p) < 2**63), None)
    if big is not None:
        raise UsageError(f"token list: id {big} is far outside any vocabulary; pass ids like 1,2,3")
    ids = np.array([int(p) for p in parts], dtype=np.int64)
    if ids.size == 0:
        raise UsageError("the token list is empty")
    return ids


def parse_mode(mode: str, n: int) -> tuple[int, int | None]:
    """prefill | step | chunk:N -> (attention chunk, prefill segment or None for the default).

    step is a decode step per token: segments of one."""
    if mode == "prefill":
        return max(n, 1), None
    if mode == "step":
        return 1, 1
    if mode.startswith("chunk:"):
        try:
            size = int(mode.split(":", 1)[1])
        except ValueError:
            size = 0
        if size >= 1:
            return size, None
    raise UsageError(f"--mode {mode!r}: use prefill, step or chunk:N with N >= 1")


@click.command("logits")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--tokens", help="Token ids, comma separated: 1,2,3.")
@click.option(
    "--tokens-file", type=click.Path(path_type=Path, dir_okay=False), help="Ids in a text file or a .npy array."
)
@click.option("--out", "out", required=True, type=click.Path(path_type=Path, dir_okay=False), help="Output .npy file.")
@click.option("--mode", default="prefill", show_default=True, help="prefill | step | chunk:N")
@numerics_option(None)
@click.option(
    "--index-keys",
    type=click.Choice(["owner", "as-shipped"]),
    default=None,
    help="V4.1: owner (each source's own index keys, prefill = decode; the default) or as-shipped"
    " (DeepSeek's decode: stale keys on ratio-2 sources every other step).",
)
@click.option("--threads", type=int, default=None, help="Kernel threads (results do not depend on it).")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def logits(
    checkpoint: Path, tokens, tokens_file, out: Path, mode: str, numerics, index_keys, threads, debug: bool
) -> None:
    """Write float32 logits [T, vocab] for every position of a token sequence."""
    check_output(out, "--out")
    ids = parse_tokens(tokens, tokens_file)
    chunk, segment = parse_mode(mode, ids.size)
    opts = V41Options(index_keys=index_keys) if index_keys is not None else None
    eng = Engine.open(checkpoint, threads=threads, v41=opts, numerics=numerics)
    session = eng.session(chunk_size=chunk, segment=segment)
    result = session.prefill(ids).astype(np.float32, copy=False)
    with AtomicFile(out, "wb") as f:  # keep the exact name (np.save would append .npy)
        np.save(f.file, result)
    click.echo(f"{out}: logits {result.shape[0]} x {result.shape[1]} float32 ({mode})")
