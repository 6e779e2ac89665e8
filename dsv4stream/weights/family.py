"""Which builder of named weights a checkpoint's family uses: V4's (`loading`) or V4.1's
(`loading_v41`). Providers (the in-memory trunk, the streamed ring) build layers and the head
through these two functions only, so they serve both families unchanged."""

from __future__ import annotations

from ..checkpoint.catalog import TensorSource
from ..checkpoint.config import V41
from .loading import load_head, load_layer
from .loading_v41 import load_head_v41, load_layer_v41


def load_block(src: TensorSource, layer: int):
    """Main layer `layer`'s dense weights: `LayerWeights` (V4) or `V41LayerWeights` (V4.1)."""
    return (load_layer_v41 if src.config.family == V41 else load_layer)(src, layer)


def load_top(src: TensorSource):
    """The head's weights: `HeadWeights` (V4) or `V41HeadWeights` (V4.1)."""
    return (load_head_v41 if src.config.family == V41 else load_head)(src)
