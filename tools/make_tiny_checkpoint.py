#!/usr/bin/env python3
"""Generate a checkpoint in the official DeepSeek-V4 release format (random weights).

Usage: tools/make_tiny_checkpoint.py OUT [--preset tiny|tiny-0731|demo|flash-experts|flash|flash-0731|
       tiny-v41|tiny-v41-long|demo-v41|flash-v41] [--layers N]
       [--seed N] [--set key=json_value ...] [--scale-fmt ue8m0|float] [--dense-dtype fp8|bf16|f32]
       [--compressor-dtype bf16|fp8] [--route-skew A] [--expert-gain G] [--tokenizer/--no-tokenizer]
       [--sparse-experts/--dense-experts]

`flash`, `flash-0731` and `flash-v41` write every tensor of the release at its real shape, routed
experts (and V4.1's Engram tables) as sparse-file holes (see dsv4stream/synth/).
`--layers N` (V4.1 presets) gives another depth with a consistent layer plan
(dsv4stream/synth/v41.py: layer_plan).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4stream.errors import Dsv4Error
from dsv4stream.synth import all_presets, make_checkpoint
from dsv4stream.synth.v41 import PRESETS_V41, layer_plan


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--preset", type=click.Choice(all_presets()), default="tiny", show_default=True)
@click.option("--layers", type=int, default=None, help="V4.1 presets: main layers, with synth_v41.layer_plan's plan.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=JSON",
    help="Override a config.json field, e.g. --set num_hidden_layers=6",
)
@click.option("--scale-fmt", type=click.Choice(["ue8m0", "float"]), default=None)
@click.option("--dense-dtype", type=click.Choice(["fp8", "bf16", "f32"]), default=None)
@click.option("--compressor-dtype", type=click.Choice(["bf16", "fp8"]), default=None)
@click.option("--route-skew", type=float, default=None, help="Power-law expert popularity (0 = uniform).")
@click.option("--expert-gain", type=float, default=None)
@click.option(
    "--output-gain-log2",
    type=int,
    default=None,
    help="Scale attn.wo_b, every w2 and engram.wkv by 2^K (exactly, through their scales); K < 0 damps.",
)
@click.option(
    "--tokenizer/--no-tokenizer",
    default=None,
    help="Copy the real tokenizer (V4's for V4.1 until text.tokenizer writes V4.1's; default: when vocab is 129280).",
)
@click.option(
    "--sparse-experts/--dense-experts",
    default=None,
    help="Routed experts (and V4.1's Engram tables) as sparse-file holes (read as zeros, no disk). "
    "[default: for flash, flash-0731, flash-v41]",
)
def main(
    out,
    preset,
    layers,
    seed,
    sets,
    scale_fmt,
    dense_dtype,
    compressor_dtype,
    route_skew,
    expert_gain,
    output_gain_log2,
    tokenizer,
    sparse_experts,
):
    overrides = {}
    if layers is not None:
        if preset not in PRESETS_V41:
            raise SystemExit("make_tiny_checkpoint: --layers is for the V4.1 presets; use --set for V4")
        try:
            overrides.update(layer_plan(layers))
        except Dsv4Error as e:
            raise SystemExit(f"make_tiny_checkpoint: {e}") from None
    for s in sets:
        k, _, v = s.partition("=")
        try:
            overrides[k] = json.loads(v)
        except ValueError:
            overrides[k] = v
    for k, v in {
        "scale_fmt": scale_fmt,
        "dense_dtype": dense_dtype,
        "compressor_dtype": compressor_dtype,
        "route_skew": route_skew,
        "expert_gain": expert_gain,
        "output_gain_log2": output_gain_log2,
        "tokenizer": tokenizer,
        "sparse_experts": sparse_experts,
    }.items():
        if v is not None:
            overrides[k] = v
    try:
        p = make_checkpoint(out, preset=preset, seed=seed, **overrides)
    except Dsv4Error as e:
        raise SystemExit(f"make_tiny_checkpoint: {e}") from None
    click.echo(str(p))


if __name__ == "__main__":
    main()
