"""Every tensor the model needs, with the dtypes and shapes the config implies.

Owns: the one table of checkpoint tensor names (`BLOCK`, `MODEL`, `EXPERT_LINEARS`,
`MTP_EXTRAS`: the model's named fields -> release names; every other module derives names
from it), the list of expected checkpoint tensors, the role of each (embed, head, trunk,
expert), and byte totals for planning. The catalog checks a checkpoint
against this list before any math; the generator writes exactly this list.

The `mtp.*` blocks come in two released layouts (`config.ModelConfig.layout`): the May
preview's MTP block and DeepSeek-V4-Flash-0731's three-stage DSpark drafter. Each stage is a
transformer block as below (window-only at ratio 0, scored router with gate.bias); what each
layout adds beyond the block is the one table `MTP_EXTRAS`. Both are validated; neither is run.

Release dtypes (first in each tuple): FP8 E4M3 linears with E8M0 128x128 scales; routed
experts as FP4 packed in I8 with E8M0 1x32 scales; compressor / indexer-compressor wkv and
wgate and the indexer's weights_proj in BF16 with no scale; norms BF16; mHC, sinks, `ape`
and gate bias F32; tid2eid I64; embed and head BF16. Any dense linear may also come as BF16
or F32 (no scale), or as FP8 with F32 scales; experts may have F32 scales.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from .config import CSA, DSPARK, DSPARK_V41, PREVIEW, V41, ModelConfig
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
COMPRESSOR = {"wkv": "wkv", "wgate": "wgate", "ape": "ape", "norm": "norm.weight"}  # CompressorWeights
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


def _compressor(cfg, prefix: str, layer: int, ratio: int, dim: int) -> Iterator[TensorSpec]:
    coff = 2 if ratio == 4 else 1  # ratio-4 windows overlap: two halves per slot
    d = cfg.hidden_size
    c = {k: prefix + v for k, v in COMPRESSOR.items()}
    yield from _linear(c["wkv"], coff * dim, d, "trunk", layer, BF16_LINEAR_DTYPES)
    yield from _linear(c["wgate"], coff * dim, d, "trunk", layer, BF16_LINEAR_DTYPES)
    yield from _plain(c["ape"], (ratio, coff * dim), F32_DTYPES, "trunk", layer)
    yield from _plain(c["norm"], (dim,), VECTOR_DTYPES, "trunk", layer)


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


def block_specs(cfg: ModelConfig, layer: int, with_experts: bool = True) -> Iterator[TensorSpec]:
    """Tensors of one transformer block (main layer or MTP block). with_experts=False: the
    dense trunk only, without what is read by pieces (routed experts, Engram table rows)."""
    if cfg.family == V41:
        from .spec_v41 import block_specs_v41

        yield from block_specs_v41(cfg, layer, with_experts)
        return
    n = block_names(cfg, layer)
    d, hd = cfg.hidden_size, cfg.head_dim
    ratio = cfg.ratio(layer)
    yield from shared_block_specs(cfg, n, layer)
    if ratio:
        yield from _compressor(cfg, n["attn.compressor"], layer, ratio, hd)
    if cfg.layer_kind(layer) == CSA:
        ih, ihd = cfg.index_n_heads, cfg.index_head_dim
        yield from _linear(n["attn.indexer.wq_b"], ih * ihd, cfg.q_lora_rank, "trunk", layer)
        yield from _linear(n["attn.indexer.weights_proj"], ih, d, "trunk", layer, BF16_LINEAR_DTYPES)
        yield from _compressor(cfg, n["attn.indexer.compressor"], layer, 4, ihd)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    yield from _plain(linear_names(n["moe.gate"])[0], (e, d), VECTOR_DTYPES, "trunk", layer)
    if cfg.is_hash_layer(layer):
        yield from _plain(n["moe.tid2eid"], (cfg.vocab_size, k), ("I64", "I32"), "trunk", layer)
    else:
        yield from _plain(n["moe.bias"], (e,), F32_DTYPES, "trunk", layer)
    yield from experts_block_specs(cfg, n, layer, e, with_experts)


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


# Tensors each layout adds to its mtp.K blocks beyond a transformer block:
# (which stages, name after "mtp.K.", kind, shape from the dims below, dtypes).
# D hidden, V vocab, H hc_mult, T len(dspark_target_layer_ids), R dspark_markov_rank.
# Preview: DeepSeek's inference/model.py MTPBlock. 0731: the tensor names and shapes
# reported for the published index by public loaders (main_proj FP8 [4096, 12288] + scale,
# markov_w1/w2 BF16 [129280, 256], confidence_head.proj BF16 [1, 4352] = [1, D + R]); the
# main_norm / norm widths (D) and the hc_head / Markov / confidence dtypes are inferred from
# the DSpark code that reads them and from the index's byte total (tests/test_spec.py).
Shape = Callable[[int, int, int, int, int], tuple[int, ...]]
MTP_EXTRAS: dict[str, tuple[tuple[str, str, str, Shape, tuple[str, ...]], ...]] = {
    PREVIEW: (
        ("all", "e_proj", "linear", lambda D, V, H, T, R: (D, D), LINEAR_DTYPES),
        ("all", "h_proj", "linear", lambda D, V, H, T, R: (D, D), LINEAR_DTYPES),
        ("all", "enorm.weight", "plain", lambda D, V, H, T, R: (D,), VECTOR_DTYPES),
        ("all", "hnorm.weight", "plain", lambda D, V, H, T, R: (D,), VECTOR_DTYPES),
        ("all", "norm.weight", "plain", lambda D, V, H, T, R: (D,), VECTOR_DTYPES),
        ("all", "hc_head_fn", "plain", lambda D, V, H, T, R: (H, H * D), F32_DTYPES),
        ("all", "hc_head_base", "plain", lambda D, V, H, T, R: (H,), F32_DTYPES),
        ("all", "hc_head_scale", "plain", lambda D, V, H, T, R: (1,), F32_DTYPES),
    ),
    DSPARK: (
        ("first", "main_proj", "linear", lambda D, V, H, T, R: (D, D * T), LINEAR_DTYPES),
        ("first", "main_norm.weight", "plain", lambda D, V, H, T, R: (D,), VECTOR_DTYPES),
        ("last", "norm.weight", "plain", lambda D, V, H, T, R: (D,), VECTOR_DTYPES),
        ("last", "hc_head_fn", "plain", lambda D, V, H, T, R: (H, H * D), F32_DTYPES),
        ("last", "hc_head_base", "plain", lambda D, V, H, T, R: (H,), F32_DTYPES),
        ("last", "hc_head_scale", "plain", lambda D, V, H, T, R: (1,), F32_DTYPES),
        ("last", "markov_head.markov_w1.weight", "plain", lambda D, V, H, T, R: (V, R), VECTOR_DTYPES),
        ("last", "markov_head.markov_w2.weight", "plain", lambda D, V, H, T, R: (V, R), VECTOR_DTYPES),
        ("last", "confidence_head.proj.weight", "plain", lambda D, V, H, T, R: (1, D + R), VECTOR_DTYPES),
    ),
}


def mtp_extra_specs(cfg: ModelConfig, k: int) -> Iterator[TensorSpec]:
    """What block mtp.k holds beyond a transformer block, per `MTP_EXTRAS`."""
    layer = cfg.n_layers + k
    p = layer_prefix(cfg, layer)
    last, ds = cfg.n_mtp - 1, cfg.dspark
    dims = (
        cfg.hidden_size,
        cfg.vocab_size,
        cfg.hc_mult,
        len(ds.target_layer_ids) if ds else 0,
        ds.markov_rank if ds else 0,
    )
    for which, name, kind, shape_of, dtypes in MTP_EXTRAS.get(cfg.layout or "", ()):
        if which == "first" and k != 0 or which == "last" and k != last:
            continue
        shape = shape_of(*dims)
        if kind == "linear":
            yield from _linear(p + name, shape[0], shape[1], "trunk", layer, dtypes)
        else:
            yield from _plain(p + name, shape, dtypes, "trunk", layer)


def model_specs(cfg: ModelConfig, with_experts: bool = True) -> Iterator[TensorSpec]:
    """Every tensor of the checkpoint, in model order (with_experts=False: without the routed
    experts and Engram tables)."""
    if cfg.family == V41:
        from .spec_v41 import model_specs_v41

        yield from model_specs_v41(cfg, with_experts)
        return
    d, v, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    yield from _plain(MODEL["embed"], (v, d), VECTOR_DTYPES, "embed", None)
    for layer in range(cfg.n_layers):
        yield from block_specs(cfg, layer, with_experts)
    yield from _plain(MODEL["norm"], (d,), VECTOR_DTYPES, "trunk", None)
    fn, base, scale = hc_names(MODEL["hc_head"])
    yield from _plain(fn, (hc, hc * d), F32_DTYPES, "trunk", None)
    yield from _plain(base, (hc,), F32_DTYPES, "trunk", None)
    yield from _plain(scale, (1,), F32_DTYPES, "trunk", None)
    yield from _plain(linear_names(MODEL["head"])[0], (v, d), VECTOR_DTYPES, "head", None)
    for k in range(cfg.n_mtp):
        yield from mtp_extra_specs(cfg, k)
        yield from block_specs(cfg, cfg.n_layers + k, with_experts)


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


def drafter_nbytes(cfg: ModelConfig) -> int:
    """Release-dtype bytes of everything under mtp.* (routed experts included): present, not run."""
    return sum(released_nbytes(cfg, s) for s in model_specs(cfg) if s.layer is not None and s.layer >= cfg.n_layers)


def drafter_summary(cfg: ModelConfig, nbytes: int) -> str | None:
    """One line for inspect, the plan and the report: what sits under mtp.* and that it is unused."""
    if not cfg.n_mtp:
        return None
    blocks = "mtp.0" if cfg.n_mtp == 1 else f"mtp.0-{cfg.n_mtp - 1}"
    drafter = cfg.layout in (DSPARK, DSPARK_V41)
    what = f"DSpark drafter ({blocks}, {cfg.n_mtp} stages)" if drafter else f"MTP block ({blocks})"
    return f"{what}: present, unused (not read, not budgeted), {nbytes / 1e9:.2f} GB"


def unused_summary(cfg: ModelConfig, drafter_bytes: int, vision_bytes: int = 0) -> str | None:
    """One line: every part the checkpoint holds that is validated and not run (mtp.*, V4.1's vision)."""
    parts = [drafter_summary(cfg, drafter_bytes)]
    if cfg.vision is not None:
        v = cfg.vision
        parts.append(
            f"vision tower (vision.*, {v.num_hidden_layers} blocks; aligner.*, image_*): present, unused"
            f" (in a text-only run: not read, not budgeted; --image plans it), {vision_bytes / 1e9:.2f} GB"
        )
    return "; ".join(p for p in parts if p) or None


def trunk_nbytes(cfg: ModelConfig, include_mtp: bool = False) -> dict[str, int]:
    """Release-dtype bytes by role: {'embed', 'head', 'trunk'} (main layers + model level);
    include_mtp adds what is present and not run: 'mtp' (mtp.* without experts) and 'vision'."""
    out = {"embed": 0, "head": 0, "trunk": 0, "mtp": 0, "vision": 0}
    for s in model_specs(cfg, with_experts=False):
        b = released_nbytes(cfg, s)
        if s.layer is not None and s.layer >= cfg.n_layers:
            out["mtp"] += b
        else:
            out[s.role] += b
    if not include_mtp:
        out.pop("mtp")
        out.pop("vision")
    return out
