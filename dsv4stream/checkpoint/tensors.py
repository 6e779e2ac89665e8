"""The tensor vocabulary both checkpoint families share: what one expected tensor is, and its names.

Owns: `TensorSpec` (one expected tensor: name, kind, logical shape, accepted dtypes, role,
layer), the accepted dtype tuples and their item sizes, the one table of checkpoint tensor
names both families use (`BLOCK`, `MODEL`, `EXPERT_LINEARS`: the model's named fields ->
release names; every other module derives names from it) with the helpers that put a block's
prefix on them, the spec builders both tables share (a linear and its scale, an mHC triple, a
block's attention core, the shared and routed experts) and the release-dtype bytes of one
tensor. Each family's table of which tensors a checkpoint holds is `spec_v4` / `spec_v41`;
`spec` chooses between them.

Release dtypes (first in each tuple): FP8 E4M3 linears with E8M0 scales; routed experts as
FP4 packed in I8 with E8M0 1x32 scales; norms BF16; mHC, sinks and gate bias F32; embed and
head BF16. Any dense linear may also come as BF16 or F32 (no scale), or as FP8 with F32
scales; experts may have F32 scales.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from .config import ModelConfig
from .formats import fp4_scale_shape, fp8_scale_shape

LINEAR_DTYPES = ("F8_E4M3", "BF16", "F32")
BF16_LINEAR_DTYPES = ("BF16", "F8_E4M3", "F32")
SCALE_DTYPES = ("F8_E8M0", "F32")
VECTOR_DTYPES = ("BF16", "F32")
F32_DTYPES = ("F32", "BF16")
ITEMSIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}


@dataclass(frozen=True)
class TensorSpec:
    """One expected tensor.

    kind: "linear" (a .weight whose companion .scale is required iff it is quantized),
    "scale" (companion of `of`), "expert" (routed expert weight), "table" (an Engram table:
    FP8 rows with one E8M0 scale per 32 columns), "plain" (fixed shape).
    shape: the logical (rows, cols) for linear/expert weights, else the stored shape.
    role: "embed" | "head" | "trunk" | "expert" | "engram" (table rows, read by row) |
    "vision" (V4.1's tower: validated, not run).  layer: main layer index, n_layers + k for
    MTP block k, or None for model-level tensors.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    role: str
    layer: int | None
    of: str | None = None

    def stored_shape(self, dtype: str) -> tuple[int, ...]:
        """Shape on disk for the given dtype (FP4 packs two values per I8 byte)."""
        if self.kind in ("linear", "expert") and dtype == "I8":
            return (self.shape[0], self.shape[1] // 2)
        return self.shape

    def scale_shape(self, weight_dtype: str, block: tuple[int, int]) -> tuple[int, int] | None:
        """Shape of the companion scale for a weight stored as `weight_dtype`: FP8 linears per
        `block` (the config's weight_block_size), FP4 and Engram table rows per 32 columns."""
        if weight_dtype == "I8" or self.kind == "table" and weight_dtype == "F8_E4M3":
            return fp4_scale_shape(self.shape[0], self.shape[1])
        if weight_dtype == "F8_E4M3":
            return fp8_scale_shape(self.shape[0], self.shape[1], block)
        return None


# ---- the one table of checkpoint tensor names --------------------------------------------
# Block names follow the block prefix (`layer_prefix`: "layers.{i}." for main layer i,
# "mtp.{k}." for drafter block k). A linear is named by its prefix (`linear_names`: PREFIX.weight
# and, when quantized, PREFIX.scale); an mHC triple by its stem (`hc_names`); a compressor,
# the shared expert and the routed experts by a prefix the names after them follow.
LAYERS, MTP = "layers", "mtp"
WEIGHT, SCALE = "weight", "scale"
HC_PARTS = ("fn", "base", "scale")  # HcWeights / HcHeadWeights fields
EXPERT_LINEARS = ("w1", "w2", "w3")  # ExpertWeights fields, shared and routed
BLOCK = {
    "attn_norm": "attn_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "hc_attn": "hc_attn",
    "hc_ffn": "hc_ffn",
    "attn.wq_a": "attn.wq_a",
    "attn.q_norm": "attn.q_norm.weight",
    "attn.wq_b": "attn.wq_b",
    "attn.wkv": "attn.wkv",
    "attn.kv_norm": "attn.kv_norm.weight",
    "attn.wo_a": "attn.wo_a",
    "attn.wo_b": "attn.wo_b",
    "attn.sink": "attn.attn_sink",
    "attn.compressor": "attn.compressor.",
    "attn.indexer.wq_b": "attn.indexer.wq_b",
    "attn.indexer.weights_proj": "attn.indexer.weights_proj",
    "attn.indexer.compressor": "attn.indexer.compressor.",
    "moe.gate": "ffn.gate",
    "moe.bias": "ffn.gate.bias",
    "moe.tid2eid": "ffn.gate.tid2eid",
    "moe.shared": "ffn.shared_experts.",
    "moe.experts": "ffn.experts.",
}
MODEL = {"embed": "embed.weight", "norm": "norm.weight", "hc_head": "hc_head", "head": "head"}
# The order an expert's tensors are handed to the MoE (BF16/F32 experts have no scales).
EXPERT_TENSORS = tuple(f"{w}.{x}" for w in EXPERT_LINEARS for x in (WEIGHT, SCALE))
# A routed expert's tensor: groups (LAYERS or MTP, block index, expert, one of EXPERT_TENSORS).
EXPERT_NAME = re.compile(
    rf"^({LAYERS}|{MTP})\.(\d+)\.{re.escape(BLOCK['moe.experts'])}(\d+)\."
    rf"({'|'.join(re.escape(t) for t in EXPERT_TENSORS)})$"
)


def layer_prefix(cfg: ModelConfig, layer: int) -> str:
    return f"{LAYERS}.{layer}." if layer < cfg.n_layers else f"{MTP}.{layer - cfg.n_layers}."


def block_names(cfg: ModelConfig, layer: int) -> dict[str, str]:
    """`BLOCK` under block `layer`'s prefix: field -> release name (or name prefix)."""
    p = layer_prefix(cfg, layer)
    return {k: p + v for k, v in BLOCK.items()}


def expert_prefix(cfg: ModelConfig, layer: int, expert: int) -> str:
    return f"{block_names(cfg, layer)['moe.experts']}{expert}."


def linear_names(prefix: str) -> tuple[str, str]:
    """(weight, scale) names of the linear `prefix`."""
    return f"{prefix}.{WEIGHT}", f"{prefix}.{SCALE}"


def hc_names(stem: str) -> tuple[str, ...]:
    """Names of an mHC triple, in `HC_PARTS` order (fn, base, scale)."""
    return tuple(f"{stem}_{x}" for x in HC_PARTS)


def is_drafter(name: str) -> bool:
    """A tensor of the mtp.* blocks (present, not run)."""
    return name.startswith(MTP + ".")


def _linear(name: str, rows: int, cols: int, role: str, layer: int | None, dtypes=LINEAR_DTYPES):
    weight, scale = linear_names(name)
    yield TensorSpec(weight, "linear", (rows, cols), dtypes, role, layer)
    yield TensorSpec(scale, "scale", (), SCALE_DTYPES, role, layer, of=weight)


def _plain(name: str, shape: tuple[int, ...], dtypes, role: str, layer: int | None):
    yield TensorSpec(name, "plain", shape, dtypes, role, layer)


def hc_specs(cfg: ModelConfig, stem: str, layer: int | None) -> Iterator[TensorSpec]:
    hc, d = cfg.hc_mult, cfg.hidden_size
    mix = (2 + hc) * hc
    fn, base, scale = hc_names(stem)
    yield from _plain(fn, (mix, hc * d), F32_DTYPES, "trunk", layer)
    yield from _plain(base, (mix,), F32_DTYPES, "trunk", layer)
    yield from _plain(scale, (3,), F32_DTYPES, "trunk", layer)


def shared_block_specs(cfg: ModelConfig, n: Mapping[str, str], layer: int) -> Iterator[TensorSpec]:
    """What a V4 and a V4.1 block both hold (`n`: the block's names): the two norms, the mHC
    mixes, attention's low-rank projections, norms and sink."""
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    yield from _plain(n["attn_norm"], (d,), VECTOR_DTYPES, "trunk", layer)
    yield from _plain(n["ffn_norm"], (d,), VECTOR_DTYPES, "trunk", layer)
    yield from hc_specs(cfg, n["hc_attn"], layer)
    yield from hc_specs(cfg, n["hc_ffn"], layer)
    yield from _linear(n["attn.wq_a"], cfg.q_lora_rank, d, "trunk", layer)
    yield from _plain(n["attn.q_norm"], (cfg.q_lora_rank,), VECTOR_DTYPES, "trunk", layer)
    yield from _linear(n["attn.wq_b"], h * hd, cfg.q_lora_rank, "trunk", layer)
    yield from _linear(n["attn.wkv"], hd, d, "trunk", layer)
    yield from _plain(n["attn.kv_norm"], (hd,), VECTOR_DTYPES, "trunk", layer)
    yield from _linear(n["attn.wo_a"], cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups, "trunk", layer)
    yield from _linear(n["attn.wo_b"], d, cfg.o_groups * cfg.o_lora_rank, "trunk", layer)
    yield from _plain(n["attn.sink"], (h,), F32_DTYPES, "trunk", layer)


def experts_block_specs(
    cfg: ModelConfig, n: Mapping[str, str], layer: int, experts: int, with_routed: bool
) -> Iterator[TensorSpec]:
    """A block's shared expert, and its `experts` routed ones with `with_routed` (V4 and V4.1 alike)."""
    d, m = cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts
    for w, (r, c) in zip(EXPERT_LINEARS, ((m, d), (d, m), (m, d)), strict=True):
        yield from _linear(n["moe.shared"] + w, r, c, "trunk", layer)
    if with_routed:
        for x in range(experts):
            yield from expert_specs(cfg, layer, x, n["moe.experts"])


def expert_specs(cfg: ModelConfig, layer: int, expert: int, experts_prefix: str | None = None) -> Iterator[TensorSpec]:
    """One routed expert's tensors; `experts_prefix` (block_names(...)['moe.experts']) saves
    rebuilding the block's names for each of hundreds of experts."""
    p = f"{experts_prefix}{expert}." if experts_prefix is not None else expert_prefix(cfg, layer, expert)
    d, m = cfg.hidden_size, cfg.moe_intermediate_size
    wdt = ("I8",) if cfg.expert_dtype == "fp4" else ("F8_E4M3",)
    for w, (r, c) in zip(EXPERT_LINEARS, ((m, d), (d, m), (m, d)), strict=True):
        weight, scale = linear_names(p + w)
        yield TensorSpec(weight, "expert", (r, c), wdt, "expert", layer)
        yield TensorSpec(scale, "scale", (), SCALE_DTYPES, "expert", layer, of=weight)


def released_nbytes(cfg: ModelConfig, s: TensorSpec) -> int:
    """Bytes of `s` when stored with its release dtype (the first listed)."""
    dt = s.dtypes[0]
    if s.kind == "scale":
        return 0  # counted with its weight
    n = 1
    for x in s.stored_shape(dt):
        n *= x
    total = n * ITEMSIZE[dt]
    sshape = s.scale_shape(dt, cfg.fp8_block) if s.kind in ("linear", "expert", "table") else None
    if sshape:
        total += sshape[0] * sshape[1] * (1 if cfg.scale_fmt == "ue8m0" else 4)
    return total
