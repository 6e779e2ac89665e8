"""The hook a forward pass reports its intermediate arrays through (a `Session`'s `trace`, which the
oracle tests compare with DeepSeek's reference): one type the session and the stacks agree on."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# trace(what, layer, array): what is "attn" (T, D), "ffn" (T, D), "hidden" (T, hc, D) after the
# layer, "index" (T, K) the indexer's rows at ratio-4 layers (-1 = none), or "input"
# (T, hc, D) the streams entering the layer after its Engram (what the DSpark drafter taps)
Trace = Callable[[str, int, np.ndarray], None]
