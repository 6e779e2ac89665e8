"""Model-agnostic expert store: byte layouts, aligned O_DIRECT reads, an LRU of slots, a verifier.

``runs`` (Piece, Run, merge_pieces) -> ``directio`` (aligned windows, reads) -> ``cache``
(ExpertStore) ; ``verify`` checks the result independently; ``layout`` maps a checkpoint's
routed experts onto keys ``(layer, expert)``.
"""

from .cache import ExpertStore, StoreStats
from .runs import Layout, Piece, Run, layout_nbytes, layout_pieces, merge_pieces

__all__ = ["ExpertStore", "Layout", "Piece", "Run", "StoreStats", "layout_nbytes", "layout_pieces", "merge_pieces"]
