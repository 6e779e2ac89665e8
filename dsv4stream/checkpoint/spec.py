"""The family switch over the checkpoint tables, and the byte accounting built on them.

Owns: `model_specs` / `block_specs` (every expected tensor of a checkpoint / of one block,
from V4's table `spec_v4` or V4.1's `spec_v41` by `config.family`: the one place the family
picks a table) and the byte totals for planning, inspect and the report (`trunk_nbytes`,
`drafter_nbytes`, what is present and not run). The catalog checks a checkpoint against
`model_specs` before any math; the generator (`dsv4stream.synth`) writes exactly this list.
The vocabulary both tables use (`TensorSpec`, the name table) is `tensors`.
"""

from __future__ import annotations

from collections.abc import Iterator

from .config import DSPARK, DSPARK_V41, V4, V41, ModelConfig
from .spec_v4 import block_specs_v4, model_specs_v4
from .spec_v41 import block_specs_v41, model_specs_v41
from .tensors import TensorSpec, released_nbytes

# config.family -> that family's table: the one place the checkpoint side picks a family.
BLOCK_SPECS = {V4: block_specs_v4, V41: block_specs_v41}
MODEL_SPECS = {V4: model_specs_v4, V41: model_specs_v41}


def block_specs(cfg: ModelConfig, layer: int, with_experts: bool = True) -> Iterator[TensorSpec]:
    """Tensors of one transformer block (main layer or MTP block). with_experts=False: the
    dense trunk only, without what is read by pieces (routed experts, Engram table rows)."""
    return BLOCK_SPECS[cfg.family](cfg, layer, with_experts)


def model_specs(cfg: ModelConfig, with_experts: bool = True) -> Iterator[TensorSpec]:
    """Every tensor of the checkpoint, in model order (with_experts=False: without the routed
    experts and Engram tables)."""
    return MODEL_SPECS[cfg.family](cfg, with_experts)


def drafter_nbytes(cfg: ModelConfig) -> int:
    """Release-dtype bytes of everything under mtp.* (routed experts included): present, not run."""
    return sum(released_nbytes(cfg, s) for s in model_specs(cfg) if s.layer is not None and s.layer >= cfg.n_layers)


def drafter_summary(cfg: ModelConfig, nbytes: int) -> str | None:
    """One line for inspect, the plan and the report: what sits under mtp.* and that it is unused."""
    if not cfg.n_mtp:
        return None
    blocks = "mtp.0" if cfg.n_mtp == 1 else f"mtp.0-{cfg.n_mtp - 1}"
    drafter = cfg.layout in (DSPARK, DSPARK_V41)
    what = f"DSpark drafter ({blocks}, {cfg.n_mtp} stages)" if drafter else f"MTP block ({blocks})"
    if drafter and cfg.dspark is not None:  # V4.1's and 0731's: run by engine/speculate_v41.py
        return f"{what}: run by --speculate (default auto); with --speculate off not read, not budgeted, {nbytes / 1e9:.2f} GB"
    return f"{what}: present, unused (not read, not budgeted), {nbytes / 1e9:.2f} GB"


def unused_summary(cfg: ModelConfig, drafter_bytes: int | None, vision_bytes: int = 0) -> str | None:
    """One line: every part the checkpoint holds that is validated and not run (mtp.*, V4.1's vision;
    `drafter_bytes` None: the drafter runs, --speculate)."""
    parts = [drafter_summary(cfg, drafter_bytes) if drafter_bytes is not None else None]
    if cfg.vision is not None:
        v = cfg.vision
        parts.append(
            f"vision tower (vision.*, {v.num_hidden_layers} blocks; aligner.*, image_*): present, unused"
            f" (in a text-only run: not read, not budgeted; --image plans it), {vision_bytes / 1e9:.2f} GB"
        )
    return "; ".join(p for p in parts if p) or None


def trunk_nbytes(cfg: ModelConfig, include_mtp: bool = False) -> dict[str, int]:
    """Release-dtype bytes by role: {'embed', 'head', 'trunk'} (main layers + model level);
    include_mtp adds what is present and not run: 'mtp' (mtp.* without experts) and 'vision'."""
    out = {"embed": 0, "head": 0, "trunk": 0, "mtp": 0, "vision": 0}
    for s in model_specs(cfg, with_experts=False):
        b = released_nbytes(cfg, s)
        if s.layer is not None and s.layer >= cfg.n_layers:
            out["mtp"] += b
        else:
            out[s.role] += b
    if not include_mtp:
        out.pop("mtp")
        out.pop("vision")
    return out
