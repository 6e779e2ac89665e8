"""Byte layouts of the trunk's groups (each main layer, the head, the embedding).

Owns: which tensors form a group, where their bytes are (the packed trunk when it holds
them, else the shards) and the aligned windows one slot read fetches (`Group.plan`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from ..checkpoint.catalog import NP_DTYPE, Catalog, TensorEntry
from ..checkpoint.spec import block_specs, model_specs
from ..checkpoint.tensors import MODEL, hc_names
from ..store import Layout, Piece, merge_pieces
from ..store.directio import ALIGN, SlotPlan, plan_slot
from ..trunkpack.reader import TrunkFile

# Neighbouring tensors closer than this are read in one window (the packed trunk pads
# tensors to 64 bytes; in the shards it merges a layer's small tensors).
MERGE_GAP = ALIGN

HEAD_NAMES = (MODEL["norm"], *hc_names(MODEL["hc_head"]))  # read with the head (the head matrix by its spec)


@dataclass(frozen=True)
class Group:
    """One trunk group read as a unit: its tensors as a store layout and its slot plan."""

    label: str
    layout: Layout
    plan: SlotPlan
    entries: dict[str, TensorEntry]  # name -> where the bytes are (shard or trunk.bin)

    @property
    def nbytes(self) -> int:
        """Slot bytes the group needs (aligned windows included)."""
        return self.plan.nbytes


@dataclass(frozen=True)
class TrunkLayout:
    """Where every resident or streamed trunk tensor is: per main layer, the head, the embedding."""

    layers: tuple[Group, ...]
    head: Group
    embed: TensorEntry
    packed: bool  # True when any group comes from a packed trunk

    @property
    def layer_bytes(self) -> tuple[int, ...]:
        return tuple(g.nbytes for g in self.layers)


def _group(label: str, entries: Mapping[str, TensorEntry]) -> Group:
    located = [
        (e.path, Piece(e.name, e.offset, e.nbytes, np.dtype(NP_DTYPE[e.dtype]), e.shape)) for e in entries.values()
    ]
    layout = merge_pieces(located, MERGE_GAP)
    return Group(label, layout, plan_slot(layout), dict(entries))


def without(group: Group, names: frozenset[str]) -> Group:
    """`group` less the tensors `names` (which the run reads elsewhere: the BF16 head mapped from
    its file while fast reads the int8 copy, `run.planner_head`)."""
    return _group(group.label, {n: e for n, e in group.entries.items() if n not in names})


def trunk_layout(cat: Catalog, trunk: TrunkFile | None = None, exclude: frozenset[str] = frozenset()) -> TrunkLayout:
    """Groups of the checkpoint's trunk; tensors the pack holds come from it, the rest from the
    shards; `exclude` names tensors that live elsewhere (in VRAM with --gpu) and are never read."""
    cfg = cat.config

    def locate(name: str) -> TensorEntry:
        if trunk is not None and trunk.has(name):
            t = trunk.entry(name)
            return TensorEntry(name, trunk.path, t.offset, t.nbytes, t.dtype, t.shape)
        return cat.entry(name)

    def present(names: Iterable[str]) -> dict[str, TensorEntry]:
        # a scale exists only for quantized weights: the catalog's validation decided which
        return {n: locate(n) for n in names if n in cat.entries and n not in exclude}

    layers = tuple(
        _group(f"layer {i}", present(s.name for s in block_specs(cfg, i, with_experts=False)))
        for i in range(cfg.n_layers)
    )
    head_names = [*HEAD_NAMES, *(s.name for s in model_specs(cfg, with_experts=False) if s.role == "head")]
    head = _group("head", present(head_names))
    packed = trunk is not None and any(e.path == trunk.path for g in (*layers, head) for e in g.entries.values())
    return TrunkLayout(layers, head, locate(MODEL["embed"]), packed)
