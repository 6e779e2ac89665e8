"""The weights layer's one family switch: `LOADERS` maps a checkpoint's family to the builders of
its named weights, V4's (`loading_v4`) or V4.1's (`loading_v41`). Providers (the in-memory trunk,
the streamed ring, a VRAM placement's source) build layers and the head through `load_block` and
`load_top` only, so they serve both families unchanged. Experts are built alike (`loading`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..checkpoint.catalog import TensorSource
from ..checkpoint.config import V4, V41
from ..model.v4.layer import HeadWeights, LayerWeights
from ..model.v41.block import V41HeadWeights, V41LayerWeights
from . import loading_v4, loading_v41

# A main layer's and the head's named weights, of either family (what a `Trunk` hands out).
BlockWeights = LayerWeights | V41LayerWeights
TopWeights = HeadWeights | V41HeadWeights


@dataclass(frozen=True)
class Loaders:
    """A family's builders: a main layer's dense weights, and the head's."""

    layer: Callable[[TensorSource, int], BlockWeights]
    head: Callable[[TensorSource], TopWeights]


LOADERS = {
    V4: Loaders(loading_v4.load_layer, loading_v4.load_head),
    V41: Loaders(loading_v41.load_layer, loading_v41.load_head),
}


def load_block(src: TensorSource, layer: int) -> BlockWeights:
    """Main layer `layer`'s dense weights: `LayerWeights` (V4) or `V41LayerWeights` (V4.1)."""
    return LOADERS[src.config.family].layer(src, layer)


def load_top(src: TensorSource) -> TopWeights:
    """The head's weights: `HeadWeights` (V4) or `V41HeadWeights` (V4.1)."""
    return LOADERS[src.config.family].head(src)
