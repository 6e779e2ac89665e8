"""The list of sub-commands: one import per command module, so the CLI stays a thin shell."""

from __future__ import annotations

import difflib
import importlib
from pathlib import Path

import click

from ..errors import UsageError

# module name -> attribute names of click commands in dsv4stream.cli.<module>
MODULES: dict[str, tuple[str, ...]] = {
    "run": ("run",),
    "inspect": ("inspect",),
    "doctor": ("doctor",),
    "tokenizer": ("pack_tokenizer_cmd", "tokenize_cmd"),
    "pack": ("pack_trunk_cmd", "upgrade_trunk_cmd"),
    "logits": ("logits",),
    "bench": ("bench",),
    "serve": ("serve",),
    "perplexity": ("perplexity",),
}


def commands() -> list[click.Command]:
    out = []
    for mod, names in MODULES.items():
        m = importlib.import_module(f"dsv4stream.cli.{mod}")
        out.extend(getattr(m, n) for n in names)
    return out


def check_not_a_typo(word: str, names: list[str], prog: str) -> None:
    """A first word that is neither a sub-command nor an existing path but looks like a
    sub-command is a typo (`dsv4 inpsect CKPT`): say so instead of "no such checkpoint"."""
    if word.startswith("-") or Path(word).exists():
        return
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    if close:
        raise UsageError(
            f"{word}: no such command or checkpoint directory; did you mean `{prog} {close[0]}`? (`{prog} --help` lists them)"
        )
