"""The list of sub-commands: one import per command module, so the CLI stays a thin shell."""

from __future__ import annotations

import importlib

import click

# module name -> attribute names of click commands in dsv4stream.commands.<module>
MODULES: dict[str, tuple[str, ...]] = {
    "inspect": ("inspect",),
    "doctor": ("doctor",),
    "pack": ("pack_trunk_cmd",),
    "logits": ("logits",),
    "tokenizer": ("pack_tokenizer_cmd", "tokenize_cmd"),
    "run": ("run",),
}


def commands() -> list[click.Command]:
    out = []
    for mod, names in MODULES.items():
        try:
            m = importlib.import_module(f"dsv4stream.commands.{mod}")
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("dsv4stream.commands"):
                continue  # a command module still being written
            raise
        out.extend(getattr(m, n) for n in names)
    return out
