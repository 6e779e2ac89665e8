"""Per-(layer, expert) layouts of a checkpoint's routed experts, from the catalog.

Owns the one place where expert tensor names are translated: ``layers.L.ffn.experts.E.
w{1,2,3}.{weight,scale}`` (and ``mtp.M.ffn.experts...``, keyed as layer
``num_hidden_layers + M``) become key ``(L, E)`` -> a ``Layout`` whose six pieces are
merged into as few runs as the file allows (two on the release layout: three scales,
then far away three weights). The store returns pieces in file order; ``arrange`` puts
them back in the fixed order of ``ExpertPieces`` with a per-key permutation computed here,
so the MoE layer never depends on how a shard happens to order its tensors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dsv4stream.catalog import NP_DTYPE, TensorEntry
from dsv4stream.errors import CheckpointError

from .runs import Layout, Piece, layout_pieces, merge_pieces

ExpertKey = tuple[int, int]

# Fixed piece order of ExpertPieces; a scale is absent for BF16/F32 experts.
EXPERT_TENSORS = ("w1.weight", "w1.scale", "w2.weight", "w2.scale", "w3.weight", "w3.scale")

_EXPERT_NAME = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w[123]\.(?:weight|scale))$")


class ExpertPieces(NamedTuple):
    """One routed expert's arrays as stored (views into its slot). Shapes for FP4:
    w1, w3 (I, D/2) uint8, scales (I, D/32); w2 (D, I/2), scale (D, I/32)."""

    w1: np.ndarray
    w1_scale: np.ndarray | None
    w2: np.ndarray
    w2_scale: np.ndarray | None
    w3: np.ndarray
    w3_scale: np.ndarray | None


@dataclass(frozen=True)
class ExpertLayouts:
    """``layouts[(L, E)]`` for the store; ``order[(L, E)][i]`` is the index in the store's
    tuple of ``EXPERT_TENSORS[i]`` (-1 when that tensor is absent)."""

    layouts: dict[ExpertKey, Layout]
    order: dict[ExpertKey, tuple[int, ...]]

    def arrange(self, key: ExpertKey, views: Sequence[np.ndarray]) -> ExpertPieces:
        """The store's views of ``key`` in ``ExpertPieces`` order."""
        return ExpertPieces(*(views[i] if i >= 0 else None for i in self.order[key]))

    @property
    def expert_nbytes(self) -> int:
        """Bytes of the largest expert's tensors (not counting alignment)."""
        return max((sum(p.nbytes for p in layout_pieces(v)) for v in self.layouts.values()), default=0)

    @property
    def max_runs(self) -> int:
        return max((len(v) for v in self.layouts.values()), default=0)


def expert_layouts(entries: Mapping[str, TensorEntry], num_hidden_layers: int, max_gap: int = 0) -> ExpertLayouts:
    """Group ``entries`` (a catalog's) into per-expert layouts; refuse incomplete experts."""
    grouped: dict[ExpertKey, dict[str, TensorEntry]] = {}
    for name, entry in entries.items():
        m = _EXPERT_NAME.match(name)
        if m is None:
            continue
        layer = int(m.group(2)) + (num_hidden_layers if m.group(1) == "mtp" else 0)
        grouped.setdefault((layer, int(m.group(3))), {})[m.group(4)] = entry
    layouts: dict[ExpertKey, Layout] = {}
    order: dict[ExpertKey, tuple[int, ...]] = {}
    for key in sorted(grouped):
        tensors = grouped[key]
        missing = [t for t in EXPERT_TENSORS if t.endswith(".weight") and t not in tensors]
        scaled = [t for t in EXPERT_TENSORS if t.endswith(".scale") and t in tensors]
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
        order[key] = tuple(
            names.index(tensors[t].name) if t in tensors else -1 for t in EXPERT_TENSORS
        )
    return ExpertLayouts(layouts, order)


def _piece(e: TensorEntry) -> Piece:
    return Piece(e.name, e.offset, e.nbytes, np.dtype(NP_DTYPE[e.dtype]), e.shape)


def expert_label(key: ExpertKey) -> str:
    """How errors name an expert key."""
    return f"layer {key[0]} expert {key[1]}"
