"""Named weights of a DeepSeek-V4.1 model, built once from checkpoint tensors.

Owns: filling V4.1's frozen dataclasses (`model.v41.block.V41LayerWeights`, its attention,
compressor, indexer, MoE and Engram parts, `V41HeadWeights`) from a `TensorSource` (the
catalog, a packed-trunk slot, a VRAM placement), by the names in `checkpoint.spec_v41`.
Routed experts load as in V4 (`loading.load_expert`: the same FP4 per-32 format). The
Engram tables are not here: their rows stream through an `EngramRows` provider.

Float32 for the small vectors; linears stay as stored (`QWeight`). The compressor's BF16
linears keep their dtype: DeepSeek promotes them to float32 for the ratio-2 pooling, which
changes no value.
"""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np

from ..checkpoint.catalog import TensorSource
from ..checkpoint.spec_v41 import BLOCK_V41, COMPRESSOR_V41, MODEL_V41, engram_names
from ..checkpoint.tensors import EXPERT_LINEARS, block_names, layer_prefix
from ..model.moe import ExpertWeights
from ..model.v41.attention import V41AttnWeights
from ..model.v41.block import V41HeadWeights, V41LayerWeights
from ..model.v41.engram import EngramWeights
from ..model.v41.indexer import V41IndexerWeights
from ..model.v41.kv import IndexKeyWeights, V41CompressorWeights
from ..model.v41.moe import V41MoeWeights
from ..model.v41.vision import VisionBlockWeights, VisionWeights
from .loading import attn_projections, hc_weights

_BF16 = np.dtype(ml_dtypes.bfloat16)


def load_layer(src: TensorSource, layer: int) -> V41LayerWeights:
    """All dense weights of main layer `layer` (routed experts and the Engram table excluded)."""
    cfg = src.config
    sh = cfg.shared
    n = block_names(cfg, layer)
    extra = {k: layer_prefix(cfg, layer) + v for k, v in BLOCK_V41.items()}
    compressor = keys = indexer = None
    if sh.is_kv_source(layer):
        c = {k: n["attn.compressor"] + v for k, v in COMPRESSOR_V41.items()}
        ratio = cfg.ratio(layer)
        compressor = V41CompressorWeights(
            wkv=src.qweight(c["wkv"]),
            wgate=src.qweight(c["wgate"]) if ratio > 1 else None,
            norm=src.f32(c["norm"]),
            ratio=ratio,
        )
        if sh.is_index_source(layer):
            keys = IndexKeyWeights(
                wk=src.qweight(extra["attn.indexer.wk"]), k_norm=src.f32(extra["attn.indexer.k_norm"])
            )
    if sh.is_index_source(layer):
        indexer = V41IndexerWeights(
            wq_b=src.qweight(n["attn.indexer.wq_b"]), weights_proj=src.qweight(n["attn.indexer.weights_proj"])
        )
    attn = V41AttnWeights(
        **attn_projections(src, n),
        compressor=compressor,
        keys=keys,
        indexer=indexer,
    )
    moe = V41MoeWeights(
        gate=src.qweight(n["moe.gate"]),
        bias=src.f32(n["moe.bias"]),
        bias_vl=src.f32(extra["moe.bias_vl"]) if src.has(extra["moe.bias_vl"]) else None,
        shared=ExpertWeights(**{w: src.qweight(n["moe.shared"] + w) for w in EXPERT_LINEARS}),
    )
    engram = None
    if cfg.is_engram_layer(layer):
        e = engram_names(cfg, layer)
        qk = src.f32(e["q_weight"]) * src.f32(e["k_weight"])
        engram = EngramWeights(wkv=src.qweight(e["wkv"]), qk=np.ascontiguousarray(qk, dtype=np.float32))
    return V41LayerWeights(
        index=layer,
        attn_norm=src.f32(n["attn_norm"]),
        ffn_norm=src.f32(n["ffn_norm"]),
        hc_attn=hc_weights(src, n["hc_attn"]),
        hc_ffn=hc_weights(src, n["hc_ffn"]),
        attn=attn,
        moe=moe,
        engram=engram,
    )


def load_head(src: TensorSource) -> V41HeadWeights:
    return V41HeadWeights(norm=src.f32(MODEL_V41["norm"]), head=replace(src.qweight(MODEL_V41["head"]), role="head"))


def load_vision(src: TensorSource, cfg) -> VisionWeights:
    """The vision tower, aligner and image delimiters: matrices kept as stored, BF16 (half the
    bytes of float32: 0.97 GB at release size; `model.v41.vision` widens a block of rows at a
    time), vectors as float32 (their BF16 values)."""
    from ..checkpoint.spec_v41 import VISION_BLOCK

    v = src.f32

    def f(name: str) -> np.ndarray:
        if src.entry(name).dtype != "BF16" or len(src.entry(name).shape) != 2:
            return v(name)
        return src.read(name).view(_BF16)

    blocks = []
    for b in range(cfg.vision.num_hidden_layers):
        n = {k: f"vision.blocks.{b}.{s}" for k, s in VISION_BLOCK.items()}
        blocks.append(
            VisionBlockWeights(
                norm1=v(n["norm1"]),
                wqkv=f(n["wqkv"] + ".weight"),
                bqkv=v(n["wqkv"] + ".bias"),
                wo=f(n["wo"] + ".weight"),
                bo=v(n["wo"] + ".bias"),
                norm2=v(n["norm2"]),
                w1=f(n["w1"]),
                w2=f(n["w2"]),
            )
        )
    return VisionWeights(
        patch_w=f("vision.patch_embed.proj.weight"),
        patch_b=v("vision.patch_embed.proj.bias"),
        blocks=tuple(blocks),
        norm=v("vision.norm.weight"),
        align_w1=f("aligner.w1.weight"),
        align_b1=v("aligner.w1.bias"),
        align_w2=f("aligner.w2.weight"),
        align_b2=v("aligner.w2.bias"),
        image_start=v("image_start"),
        image_end=v("image_end"),
        image_newline=v("image_newline"),
    )
