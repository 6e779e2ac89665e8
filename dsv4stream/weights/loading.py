"""Named weights of the model, built once from checkpoint tensors (a catalog or a look-alike).

Owns: filling the frozen dataclasses the forward pass reads (`model.layer.LayerWeights`,
`HeadWeights`, `ExpertWeights`, ...) from release tensors named by `spec`'s table; the hot
path never looks a weight up by string.

Small vectors (norms, mHC, sinks, ape, gate bias) become float32; linears stay as stored
(`QWeight`: FP8 + scale, BF16 or F32) and go through `dsv4stream.kernels`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..checkpoint.catalog import TensorSource
from ..checkpoint.config import CSA, ModelConfig
from ..checkpoint.formats import fp4_scale_shape, fp8_scale_shape
from ..checkpoint.spec import COMPRESSOR, EXPERT_LINEARS, MODEL, block_names, expert_prefix, hc_names
from ..kernels import QWeight, dense
from ..model.attention import AttnWeights
from ..model.compressor import CompressorWeights
from ..model.indexer import IndexerWeights
from ..model.layer import HeadWeights, LayerWeights
from ..model.mhc import HcHeadWeights, HcWeights
from ..model.moe import ExpertWeights, MoeWeights


def f32_qweight(a: np.ndarray) -> QWeight:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return QWeight("f32", a, None, a.shape[0], a.shape[1])


def split_rows(w: QWeight, parts: int) -> tuple[QWeight, ...]:
    """Split a linear into `parts` equal row blocks (the grouped output projection).

    FP8 blocks whose row count is not a multiple of the scale block's rows are
    dequantised to float32 first (exact; only tiny test models hit this).
    """
    r = w.rows // parts
    br = w.block[0]
    if w.kind == "fp8" and r % br:
        w = f32_qweight(dense(w))
    out = []
    for i in range(parts):
        data = w.data[i * r : (i + 1) * r]
        scale = w.scale
        if w.kind == "fp8":
            scale = w.scale[i * r // br : (i + 1) * r // br]
        out.append(replace(w, data=data, scale=scale, rows=r))
    return tuple(out)


def _hc(cat: TensorSource, stem: str, kind=HcWeights):
    fn, base, scale = hc_names(stem)
    return kind(fn=f32_qweight(cat.f32(fn)), base=cat.f32(base), scale=cat.f32(scale))


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
        wq_a=cat.qweight(n["attn.wq_a"]),
        q_norm=cat.f32(n["attn.q_norm"]),
        wq_b=cat.qweight(n["attn.wq_b"]),
        wkv=cat.qweight(n["attn.wkv"]),
        kv_norm=cat.f32(n["attn.kv_norm"]),
        wo_a=split_rows(cat.qweight(n["attn.wo_a"]), cfg.o_groups),
        wo_b=cat.qweight(n["attn.wo_b"]),
        sink=cat.f32(n["attn.sink"]),
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
        hc_attn=_hc(cat, n["hc_attn"]),
        hc_ffn=_hc(cat, n["hc_ffn"]),
        attn=attn,
        moe=moe,
    )


def load_head(cat: TensorSource) -> HeadWeights:
    return HeadWeights(
        hc=_hc(cat, MODEL["hc_head"], HcHeadWeights),
        norm=cat.f32(MODEL["norm"]),
        head=replace(cat.qweight(MODEL["head"]), role="head"),
    )


def load_expert(cat: TensorSource, layer: int, expert: int) -> ExpertWeights:
    p = expert_prefix(cat.config, layer, expert)
    return ExpertWeights(**{w: replace(cat.qweight(p + w), role="experts") for w in EXPERT_LINEARS})


def expert_from_arrays(cfg: ModelConfig, arrays: tuple[np.ndarray, ...]) -> ExpertWeights:
    """ExpertWeights from raw arrays in store order (`spec.EXPERT_TENSORS`: w1.weight, w1.scale, ...).

    Weights are FP4 packed bytes (expert_dtype "fp4") or E4M3 bytes ("fp8"); scales are
    E8M0 bytes (uint8) or float32.
    """
    d, m = cfg.hidden_size, cfg.moe_intermediate_size
    kind = cfg.expert_dtype
    out = []
    for (wt, sc), (rows, cols) in zip(zip(arrays[0::2], arrays[1::2]), ((m, d), (d, m), (m, d))):
        wt = np.asarray(wt).view(np.uint8).reshape(rows, cols // 2 if kind == "fp4" else cols)
        sshape = fp4_scale_shape(rows, cols) if kind == "fp4" else fp8_scale_shape(rows, cols, cfg.fp8_block)
        sc = np.asarray(sc)
        n = sshape[0] * sshape[1]
        # E8M0 scales are one byte each; F32 scales may arrive typed or as raw bytes
        sc = sc.view(np.uint8) if sc.nbytes == n else sc.view(np.float32)
        out.append(QWeight(kind, wt, sc.reshape(sshape), rows, cols, role="experts"))
    return ExpertWeights(*out)
