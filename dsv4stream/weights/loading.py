"""Named weights both families build the same way: linears as `QWeight`s, a linear split into row
blocks (the grouped output projection), the mHC mixings and attention projections, and the routed experts (from
a catalog or a store's raw arrays). Each family's blocks and head are `loading_v4` / `loading_v41`; `family` picks one.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..checkpoint.catalog import TensorSource
from ..checkpoint.config import ModelConfig
from ..checkpoint.formats import fp4_scale_shape, fp8_scale_shape
from ..checkpoint.tensors import EXPERT_LINEARS, expert_prefix, hc_names
from ..kernels import QWeight, dense
from ..model.mhc import HcWeights
from ..model.moe import ExpertWeights


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


def hc_weights(src: TensorSource, stem: str, kind: type = HcWeights):
    """The mHC mixing weights under `stem` (a block's hc_attn / hc_ffn, V4's hc_head with `kind`)."""
    fn, base, scale = hc_names(stem)
    return kind(fn=f32_qweight(src.f32(fn)), base=src.f32(base), scale=src.f32(scale))


def attn_projections(src: TensorSource, names: dict[str, str]) -> dict[str, object]:
    """The `model.projections.AttnProjections` fields of one layer, by its `block_names`: the keyword arguments each
    family's attention weights start from (they add what only they have)."""
    fields = {
        "wq_a": src.qweight(names["attn.wq_a"]),
        "q_norm": src.f32(names["attn.q_norm"]),
        "wq_b": src.qweight(names["attn.wq_b"]),
        "wkv": src.qweight(names["attn.wkv"]),
        "kv_norm": src.f32(names["attn.kv_norm"]),
        "wo_a": split_rows(src.qweight(names["attn.wo_a"]), src.config.o_groups),
        "wo_b": src.qweight(names["attn.wo_b"]),
        "sink": src.f32(names["attn.sink"]),
    }
    return fields


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
