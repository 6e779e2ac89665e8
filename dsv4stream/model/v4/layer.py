"""The named weights of a block and of the head: frozen containers the forward pass reads.

Owns nothing but the fields; `dsv4stream.weights.loading` fills them from checkpoint tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...kernels import QWeight
from ..mhc import HcHeadWeights, HcWeights
from ..moe import MoeWeights
from .attention import AttnWeights


@dataclass(frozen=True)
class LayerWeights:
    index: int
    attn_norm: np.ndarray  # (D,)
    ffn_norm: np.ndarray  # (D,)
    hc_attn: HcWeights
    hc_ffn: HcWeights
    attn: AttnWeights
    moe: MoeWeights


@dataclass(frozen=True)
class HeadWeights:
    hc: HcHeadWeights
    norm: np.ndarray  # (D,)
    head: QWeight  # (vocab, D)
    q8: object | None = None  # the pack's int8 copy of head (`kernels.headq8.Int8Head`): fast's logits
