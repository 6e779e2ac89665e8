"""The engine layer's one family switch: `STACKS` maps a checkpoint's family to the builder of its
layer stack (`stack_v4.build`, `stack_v41.build`), which takes the engine's wiring (trunk, experts,
catalog) and the family's own inputs (V4.1: Engram rows and hash, `V41Options`). The session
runs whichever `Stack` it gets and never asks the family again."""

from __future__ import annotations

from ..checkpoint.catalog import Catalog
from ..checkpoint.config import V4, V41, ModelConfig
from ..weights.providers import EngramRows, Experts, Trunk
from . import stack_v4, stack_v41
from .stack_v41 import EngramIds, V41Options
from .steps import Stack

STACKS = {V4: stack_v4.build, V41: stack_v41.build}


def build_stack(
    cfg: ModelConfig,
    trunk: Trunk,
    experts: Experts,
    catalog: Catalog | None,
    *,
    engram_rows: EngramRows | None = None,
    engram_ids: EngramIds | None = None,
    v41: V41Options | None = None,
) -> Stack:
    return STACKS[cfg.family](cfg, trunk, experts, catalog, engram_rows=engram_rows, engram_ids=engram_ids, v41=v41)
