"""DeepSeek-V4's named weights, built once from checkpoint tensors (a catalog or a look-alike).

Owns: filling the frozen dataclasses V4's forward pass reads (`model.v4.layer.LayerWeights`,
`HeadWeights`) from release tensors named by `spec`'s table; the hot path never looks a weight
up by string. The experts and the shared helpers are `loading`'s.

Small vectors (norms, mHC, sinks, ape, gate bias) become float32; linears stay as stored
(`QWeight`: FP8 + scale, BF16 or F32) and go through `dsv4stream.kernels`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..checkpoint.catalog import TensorSource
from ..checkpoint.config import CSA
from ..checkpoint.spec_v4 import COMPRESSOR
from ..checkpoint.tensors import EXPERT_LINEARS, MODEL, block_names
from ..model.mhc import HcHeadWeights
from ..model.moe import ExpertWeights, MoeWeights
from ..model.v4.attention import AttnWeights
from ..model.v4.compressor import CompressorWeights
from ..model.v4.indexer import IndexerWeights
from ..model.v4.layer import HeadWeights, LayerWeights
from .loading import attn_projections, hc_weights


def _compressor(cat: TensorSource, p: str) -> CompressorWeights:
    c = {k: p + v for k, v in COMPRESSOR.items()}
    return CompressorWeights(
        wkv=cat.qweight(c["wkv"]),
        wgate=cat.qweight(c["wgate"]),
        ape=np.ascontiguousarray(cat.f32(c["ape"])),
        norm=cat.f32(c["norm"]),
    )


def load_layer(cat: TensorSource, layer: int) -> LayerWeights:
    """All dense weights of main layer `layer` (routed experts excluded)."""
    cfg = cat.config
    n = block_names(cfg, layer)
    ratio = cfg.ratio(layer)
    indexer = None
    if cfg.layer_kind(layer) == CSA:
        indexer = IndexerWeights(
            wq_b=cat.qweight(n["attn.indexer.wq_b"]),
            weights_proj=cat.qweight(n["attn.indexer.weights_proj"]),
            compressor=_compressor(cat, n["attn.indexer.compressor"]),
        )
    attn = AttnWeights(
        **attn_projections(cat, n),
        ratio=ratio,
        compressor=_compressor(cat, n["attn.compressor"]) if ratio else None,
        indexer=indexer,
    )
    is_hash = cfg.is_hash_layer(layer)
    moe = MoeWeights(
        gate=cat.qweight(n["moe.gate"]),
        bias=None if is_hash else cat.f32(n["moe.bias"]),
        tid2eid=np.ascontiguousarray(cat.read(n["moe.tid2eid"]), dtype=np.int64) if is_hash else None,
        shared=ExpertWeights(**{w: cat.qweight(n["moe.shared"] + w) for w in EXPERT_LINEARS}),
    )
    return LayerWeights(
        index=layer,
        attn_norm=cat.f32(n["attn_norm"]),
        ffn_norm=cat.f32(n["ffn_norm"]),
        hc_attn=hc_weights(cat, n["hc_attn"]),
        hc_ffn=hc_weights(cat, n["hc_ffn"]),
        attn=attn,
        moe=moe,
    )


def load_head(cat: TensorSource) -> HeadWeights:
    return HeadWeights(
        hc=hc_weights(cat, MODEL["hc_head"], HcHeadWeights),
        norm=cat.f32(MODEL["norm"]),
        head=replace(cat.qweight(MODEL["head"]), role="head"),
    )
