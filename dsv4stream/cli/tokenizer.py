"""CLI commands `dsv4 pack-tokenizer` and `dsv4 tokenize`.

Owns only argument handling and printing; the work is in `dsv4stream.text.tokenizer` and
`dsv4stream.text.chat`. Errors are raised as Dsv4Error subclasses for the `dsv4` group to print.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import UsageError
from ..text import chat
from ..text.tokenizer import Tokenizer, pack_tokenizer
from ..text.vocab import family_name


def strip_final_newline(text: str) -> str:
    """Text from stdin or a file less one final line end: `echo hi` and editors add it, and it
    would otherwise become a token of its own."""
    if text.endswith("\r\n"):
        return text[:-2]
    return text.removesuffix("\n")


STDIN_LIMIT = 256 << 20  # bytes of text read from stdin at most (`< /dev/zero` must not fill the memory)


def stdin_text(what: str, limit: int = STDIN_LIMIT) -> str:
    """All of stdin as UTF-8 text, whatever the locale; anything else is one UsageError naming `what`.
    More than `limit` bytes is refused after reading `limit + 1`."""
    data = read_stdin(what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{what}: stdin is not UTF-8 text (byte {e.start} is {data[e.start]:#04x}); give UTF-8"
        ) from None


def read_stdin(what: str, limit: int) -> bytes:
    """Stdin's bytes, at most `limit` of them: one more is a UsageError (never an unbounded read)."""
    stream = sys.stdin.buffer if hasattr(sys.stdin, "buffer") else None
    chunks, got = [], 0
    while got <= limit:
        b = stream.read(min(1 << 20, limit + 1 - got)) if stream is not None else sys.stdin.read(1 << 20).encode()
        if not b:
            return b"".join(chunks)
        chunks.append(b)
        got += len(b)
    raise UsageError(f"{what}: stdin gives more than {limit:,} bytes; is it the right input?")


def describe(tok: Tokenizer) -> str:
    """One line saying what a packed tokenizer holds."""
    s = tok.special
    v41 = f" System {s.system} image {s.image}" if s.system is not None else ""
    return (
        f"{tok.path}: {family_name(tok.family)} tokenizer, {tok.n_tokens} token ids for {tok.vocab_size} embedding rows, "
        f"BOS {s.bos} EOS {s.eos} User {s.user} Assistant {s.assistant}{v41} "
        f"<think> {s.think} </think> {s.think_end}, {tok.fingerprint[:19]}"
    )


@click.command("pack-tokenizer")
@click.argument("checkpoint_dir", type=click.Path(file_okay=False, path_type=Path))
@click.argument("out", required=False, type=click.Path())  # a str: a trailing / must survive
def pack_tokenizer_cmd(checkpoint_dir: Path, out: str | None) -> None:
    """Check CHECKPOINT_DIR's tokenizer against its config.json and pack it into one file.

    OUT defaults to CHECKPOINT_DIR/dsv4-tokenizer.pack; a directory, or a path ending in /,
    means that name inside it (created if missing). Only an earlier pack is ever replaced.
    """
    path = pack_tokenizer(checkpoint_dir, out)
    click.echo(describe(Tokenizer.load(path)))


@click.command("tokenize")
@click.option(
    "--tok",
    "tok_path",
    required=True,
    type=click.Path(path_type=Path),
    help="Packed tokenizer file (or a checkpoint directory holding dsv4-tokenizer.pack).",
)
@click.option("--chat", "mode", flag_value="chat", help="Render TEXT as a one-turn chat first.")
@click.option("--think", "mode", flag_value="think", help="Same, opening a thinking block.")
@click.option("--system", default=None, help="System text of the one-turn chat.")
@click.option("--count", is_flag=True, help="Print only the number of ids.")
@click.argument("text", nargs=-1, required=True)
def tokenize_cmd(tok_path: Path, mode: str | None, system: str | None, count: bool, text: tuple[str, ...]) -> None:
    """Print the token ids of TEXT on one line, separated by single spaces.

    Several TEXT arguments are joined with one space; `-` reads TEXT from stdin, less one
    final newline (`echo hello | dsv4 tokenize -` is the ids of "hello"). Plain TEXT
    gets no BOS; --chat/--think render BOS, [system], <｜User｜>TEXT<｜Assistant｜> and
    </think> or <think>. Put `--` before TEXT that starts with a dash.
    """
    if system is not None and mode is None:
        raise UsageError("--system needs --chat or --think")
    body = strip_final_newline(stdin_text("tokenize -")) if text == ("-",) else " ".join(text)
    tok = Tokenizer.load(tok_path)
    if mode is None:
        ids = tok.encode(body)
    else:
        ids = chat.encode(tok, chat.one_turn(body, system), mode)  # the tokenizer's family picks the format
    click.echo(str(len(ids)) if count else " ".join(map(str, ids)))
