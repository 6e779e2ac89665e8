"""Per-(layer, expert) layouts of a checkpoint's routed experts, from the catalog.

Owns the translation of expert tensor names (``spec.EXPERT_NAME``: ``layers.L.ffn.experts.E.
w{1,2,3}.{weight,scale}`` and ``mtp.M.ffn.experts...``, keyed as layer ``num_hidden_layers + M``)
into key ``(L, E)`` -> a ``Layout`` whose six pieces are
merged into as few runs as the file allows (two on the release layout: three scales,
then far away three weights). Runs hold pieces in file order; ``order`` is the per-key
permutation that makes the store return them in the fixed ``EXPERT_TENSORS`` order, so
the MoE layer never depends on how a shard happens to order its tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..checkpoint.catalog import NP_DTYPE, TensorEntry
from ..checkpoint.tensors import EXPERT_NAME, EXPERT_TENSORS, MTP, SCALE, WEIGHT
from ..errors import CheckpointError
from ..store.runs import Layout, Piece, layout_pieces, merge_pieces
from ..weights.providers import ExpertKey


@dataclass(frozen=True)
class ExpertLayouts:
    """``layouts[(L, E)]`` for the store; ``order[(L, E)]``: indices into the layout's
    pieces of the tensors present, in ``EXPERT_TENSORS`` order (pass it as the store's
    ``order`` to get w1.weight, w1.scale, w2.weight, w2.scale, w3.weight, w3.scale)."""

    layouts: dict[ExpertKey, Layout]
    order: dict[ExpertKey, tuple[int, ...]]


def expert_layouts(entries: Mapping[str, TensorEntry], num_hidden_layers: int, max_gap: int = 0) -> ExpertLayouts:
    """Group ``entries`` (a catalog's) into per-expert layouts; refuse incomplete experts."""
    grouped: dict[ExpertKey, dict[str, TensorEntry]] = {}
    for name, entry in entries.items():
        m = EXPERT_NAME.match(name)
        if m is None:
            continue
        layer = int(m.group(2)) + (num_hidden_layers if m.group(1) == MTP else 0)
        grouped.setdefault((layer, int(m.group(3))), {})[m.group(4)] = entry
    layouts: dict[ExpertKey, Layout] = {}
    order: dict[ExpertKey, tuple[int, ...]] = {}
    for key in sorted(grouped):
        tensors = grouped[key]
        missing = [t for t in EXPERT_TENSORS if t.endswith(WEIGHT) and t not in tensors]
        scaled = [t for t in EXPERT_TENSORS if t.endswith(SCALE) and t in tensors]
        if missing or len(scaled) not in (0, 3):
            any_entry = next(iter(tensors.values()))
            raise CheckpointError(
                f"{any_entry.path}: routed expert layer {key[0]} expert {key[1]} has tensors "
                f"{sorted(tensors)}; expected w1/w2/w3 .weight with all or none of their .scale"
            )
        located = [(e.path, _piece(e)) for e in tensors.values()]
        layout = merge_pieces(located, max_gap)
        names = [p.name for p in layout_pieces(layout)]
        layouts[key] = layout
        order[key] = tuple(names.index(tensors[t].name) for t in EXPERT_TENSORS if t in tensors)
    return ExpertLayouts(layouts, order)


def _piece(e: TensorEntry) -> Piece:
    return Piece(e.name, e.offset, e.nbytes, np.dtype(NP_DTYPE[e.dtype]), e.shape)


def expert_label(key: ExpertKey) -> str:
    """How errors name an expert key."""
    return f"layer {key[0]} expert {key[1]}"
