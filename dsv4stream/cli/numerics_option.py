"""The `--numerics` option every command that computes takes (`engine.numerics`): one
definition, each command's own default (fast for run / serve / bench and the chat; `dsv4
logits` and `dsv4 perplexity`'s base keep the family's, so reference checks stay as they are)."""

from __future__ import annotations

import click

from ..engine.numerics import CHOICES

HELP = (
    "Activation rounding of the linears: exact (float32; alias fp32), official (DeepSeek's shipped"
    " rounding) or fast (int8 / BF16 activations on the CPU's dot-product instructions)."
)


def numerics_option(default: str | None, extra: str = ""):
    """`--numerics` with `default` (None: the checkpoint family's, V4 exact and V4.1 official)."""
    shown = f" [default: {default}]" if default is not None else " [default: V4 exact, V4.1 official]"
    return click.option("--numerics", type=click.Choice(CHOICES), default=default, help=HELP + extra + shown)
