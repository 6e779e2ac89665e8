"""The list of sub-commands: one import per command module, so the CLI stays a thin shell."""

from __future__ import annotations

import importlib

import click

# module name -> attribute names of click commands in dsv4stream.commands.<module>
MODULES: dict[str, tuple[str, ...]] = {
    "run": ("run",),
    "inspect": ("inspect",),
    "doctor": ("doctor",),
    "tokenizer": ("pack_tokenizer_cmd", "tokenize_cmd"),
    "pack": ("pack_trunk_cmd",),
    "logits": ("logits",),
    "bench": ("bench",),
    "serve": ("serve",),
}


def commands() -> list[click.Command]:
    out = []
    for mod, names in MODULES.items():
        m = importlib.import_module(f"dsv4stream.commands.{mod}")
        out.extend(getattr(m, n) for n in names)
    return out
