"""The attention projections both families share: query (low rank, normed), one KV vector, the
grouped low-rank output and the per-head sink. Each family's attention weights extend this
record with what only it has (V4: ratio, compressor, indexer; V4.1: KV sources, index keys)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import QWeight


@dataclass(frozen=True)
class AttnProjections:
    wq_a: QWeight  # (q_lora_rank, D)
    q_norm: np.ndarray  # (q_lora_rank,)
    wq_b: QWeight  # (H * hd, q_lora_rank)
    wkv: QWeight  # (hd, D)
    kv_norm: np.ndarray  # (hd,)
    wo_a: tuple[QWeight, ...]  # o_groups x (o_lora_rank, H * hd / o_groups)
    wo_b: QWeight  # (D, o_groups * o_lora_rank)
    sink: np.ndarray  # (H,)
