"""`dsv4 logits`: teacher-forced logits for every position of a token sequence.

Writes float32 [T, vocab] to a .npy file. Useful for checking the forward pass against
another implementation and for scoring text. `--mode` picks how the tokens are fed:
one prefill chunk, one token at a time (a decode step per token), or chunks of N; all give
the same numbers up to float rounding (for V4.1 with `--index-keys owner`, the default).
`--numerics exact|official|fast` (`engine.numerics`; default the family's, V4 exact and V4.1
official, so checks against references stay as they were); DeepSeek-V4.1 checkpoints also take
`--index-keys owner|as-shipped` (`engine.stack_v41.V41Options`).

Images (V4.1 with a vision tower): `--image FILE` once per `image_token_id` marker in the
tokens, in order; each marker expands to its span (`engine.images`), the logits cover the
expanded sequence, and `--embeds-out E.npz` writes `tokens` and `types` int64 [T'] (-1 text,
0 start, 1 image, 2 newline, 3 end) and `embeds` float32 [T', hidden], the input rows with the
spans filled. With images, `--mode step` is one prefill through the last span, then a step per
token (DeepSeek's reference takes images only in the first forward pass).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import click
import numpy as np

from ..checkpoint.catalog import Catalog
from ..engine.images import decode_images, image_prompt
from ..engine.session import Engine
from ..engine.stack_v41 import V41Options
from ..errors import UsageError
from ..files import AtomicFile, read_regular
from ..run.compile import prepare_kernels
from ..text.image import TEXT, read_image_file
from .numerics_option import numerics_option
from .outputs import check_output

TOKENS_FILE_LIMIT = 64 << 20  # bytes: a million ids (V4's whole context) as text or .npy is under 12 MB


def _quote(text: str, n: int = 12) -> str:
    """A few characters of user input for a message: never a file's contents (it may be a secret)."""
    return repr(text[:n]) + ("..." if len(text) > n else "")


def parse_tokens(tokens: str | None, tokens_file: Path | None) -> np.ndarray:
    """Comma/space-separated ids from --tokens, or from a text or .npy file (a regular file of at
    most TOKENS_FILE_LIMIT bytes; a .npy of integers, never pickled objects)."""
    if (tokens is None) == (tokens_file is None):
        raise UsageError("give exactly one of --tokens 1,2,3 or --tokens-file FILE")
    where = "token list"
    if tokens_file is not None:
        data = read_regular(tokens_file, "--tokens-file", UsageError, TOKENS_FILE_LIMIT)
        if tokens_file.suffix == ".npy":
            return _npy_ids(tokens_file, data)
        try:
            tokens = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(
                f"--tokens-file {tokens_file}: not UTF-8 text (byte {e.start}); give ids like 1,2,3"
            ) from None
        where = f"--tokens-file {tokens_file}"
    text = tokens.strip()
    # ids separated by commas and/or spaces; an empty field (1,,2 or a trailing comma) is a typo
    parts = re.split(r"\s*,\s*|\s+", text) if text else []
    if "" in parts:
        at = parts.index("")
        raise UsageError(f"{where}: entry {at + 1} is empty (1,,2 or a trailing comma); pass ids like 1,2,3")
    bad = next((i for i, p in enumerate(parts) if not re.fullmatch(r"-?[0-9]+", p)), None)
    if bad is not None:
        raise UsageError(f"{where}: entry {bad + 1}, {_quote(parts[bad])}, is not an integer id; pass ids like 1,2,3")
    big = next((p for p in parts if len(p) > 20 or not -(2**63) <= int(p) < 2**63), None)
    if big is not None:
        raise UsageError(f"{where}: id {_quote(big, 20)} is far outside any vocabulary; pass ids like 1,2,3")
    ids = np.array([int(p) for p in parts], dtype=np.int64)
    if ids.size == 0:
        raise UsageError("the token list is empty")
    return ids


def _npy_ids(path: Path, data: bytes) -> np.ndarray:
    """The ids of a .npy file's bytes: an integer array of any shape, flattened."""
    try:
        ids = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:  # object arrays, bad headers, short data
        raise UsageError(f"--tokens-file {path}: not a .npy array of integer ids ({str(e)[:80]})") from None
    if not isinstance(ids, np.ndarray) or not np.issubdtype(ids.dtype, np.integer):
        raise UsageError(f"--tokens-file {path}: expected an integer array, found {getattr(ids, 'dtype', type(ids))}")
    if ids.dtype.kind == "u" and ids.size and int(ids.max()) >= 2**63:
        raise UsageError(f"--tokens-file {path}: an id is far outside any vocabulary")
    return ids.reshape(-1).astype(np.int64)


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
@click.option(
    "--image",
    "images",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="V4.1: an image for the next image marker in the tokens (repeat, in order).",
)
@click.option(
    "--embeds-out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Also write tokens, types and input rows of the expanded sequence to this .npz.",
)
@click.option(
    "--draft-out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="V4.1, V4-Flash-0731: also write the DSpark drafter's outputs (positions, logits [P, B, vocab], confidence [P, B]) to this .npz.",
)
@click.option("--draft-positions", default="all", show_default=True, help="With --draft-out: all or P1,P2,...")
@click.option("--threads", type=int, default=None, help="Kernel threads (results do not depend on it).")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def logits(
    checkpoint: Path,
    tokens,
    tokens_file,
    out: Path,
    mode: str,
    numerics,
    index_keys,
    images: tuple[Path, ...],
    embeds_out: Path | None,
    draft_out: Path | None,
    draft_positions: str,
    threads,
    debug: bool,
) -> None:
    """Write float32 logits [T, vocab] for every position of a token sequence."""
    check_output(out, "--out")
    if embeds_out is not None:
        check_output(embeds_out, "--embeds-out")
    ids = parse_tokens(tokens, tokens_file)
    files = [(str(p), read_image_file(p)) for p in images]
    opts = V41Options(index_keys=index_keys) if index_keys is not None else None
    if draft_out is not None:
        check_output(draft_out, "--draft-out")
    cat = Catalog.open(checkpoint)
    cat.validate()
    # the kernels this checkpoint's numerics reach, compiled in children (with the progress line)
    # and loaded before the pass, as `Runtime.open` does for run, serve, bench and perplexity
    prepare_kernels(cat, numerics, say=lambda m: click.echo(f"dsv4: {m}", err=True))
    eng = Engine.open(checkpoint, threads=threads, v41=opts, numerics=numerics, validate=False)
    spans, types = None, np.full(ids.size, TEXT, dtype=np.int64)
    # with a vision tower every marker needs its image; without one (and no --image) the
    # marker id is an ordinary token, as in DeepSeek's forward without token types
    markers = eng.cfg.image_token_id is not None and bool(np.any(ids == eng.cfg.image_token_id))
    if files or (markers and eng.cfg.vision is not None):
        ip = image_prompt(eng, ids, decode_images(eng, files))
        ids, types, spans = ip.ids, ip.types, ip.spans
    chunk, segment = parse_mode(mode, ids.size)
    if draft_out is not None:
        if spans is not None:
            raise UsageError("--draft-out takes a text-only token sequence: leave out --image")
        _with_drafts(eng, ids, out, draft_out, draft_positions, chunk, segment)
        return
    session = eng.session(chunk_size=chunk, segment=segment)
    result = session.prefill(ids, spans=spans).astype(np.float32, copy=False)
    with AtomicFile(out, "wb") as f:  # keep the exact name (np.save would append .npy)
        np.save(f.file, result)
    if embeds_out is not None:
        emb = np.array(eng.trunk.embed(ids), dtype=np.float32)
        if spans is not None:
            spans.fill(emb)
        with AtomicFile(embeds_out, "wb") as f:
            np.savez(f.file, tokens=ids, types=types, embeds=emb)
    click.echo(f"{out}: logits {result.shape[0]} x {result.shape[1]} float32 ({mode})")


def _with_drafts(eng, ids, out: Path, draft_out: Path, spec: str, chunk: int, segment: int | None) -> None:
    """The main logits to `out` and the DSpark drafter's outputs to `draft_out` (`engine.dspark_v41`)."""
    from ..engine.dspark_v41 import draft_positions, teacher_forced_drafts
    from ..weights.loading_dspark import check_drafter, drafter_reason

    if drafter_reason(eng.cfg) is not None:  # V4.1's and V4-Flash-0731's drafters run
        check_drafter(eng.cfg)
    positions = draft_positions(spec, ids.size, eng.cfg.dspark.block_size)
    main, logits, conf = teacher_forced_drafts(eng, ids, positions, chunk, segment)
    with AtomicFile(out, "wb") as f:
        np.save(f.file, main)
    with AtomicFile(draft_out, "wb") as f:
        np.savez(f.file, positions=positions, logits=logits.astype(np.float32), confidence=conf.astype(np.float32))
    click.echo(
        f"{out}: logits {main.shape[0]} x {main.shape[1]} float32; {draft_out}: drafts at {positions.size} positions"
    )
