"""Every tensor of a DeepSeek-V4.1 checkpoint, with the dtypes and shapes the config implies.

Owns: V4.1's part of the one name table (`BLOCK_V41`, `ENGRAM`, `MODEL_V41`, `VISION`,
`MTP_EXTRAS_V41`: names V4 does not have) and the list of expected tensors, in the same
`TensorSpec` terms as `spec_v4` (`tensors`' vocabulary); `spec` dispatches here for
`family == "v41"`.

Per layer (DeepSeek's V4.1 inference/model.py, checked against the release's shard-header
ledger: 96,085 tensors, 510,286,023,000 bytes): the attention of V4 without `compressor.ape`;
`attn.compressor.{wkv, norm}` only on kv sources and `compressor.wgate` only on those of ratio
above 1; `attn.indexer.{wq_b, weights_proj}` on index sources, `attn.indexer.{wk, k_norm}` only
on kv sources; `ffn.gate.{weight, bias}` everywhere and `ffn.gate.bias_vl` (the routing bias of
image-span tokens) where the config has a vision tower; no `tid2eid` (no hash layers);
`engram.{embed, wkv, q_weight, k_weight}` on Engram layers. No `hc_head`: the last FFN's
hyper-connection mix collapses the streams. The DSpark stages (`mtp.K`) are window-only blocks
with their own expert count; stage 0 adds `main_proj`/`main_norm`, the last stage a `norm`, the
Markov head and the confidence head. The vision tower (`vision.*`), its `aligner.*` and the
image delimiters (`image_*`) are BF16.

Release dtypes: FP8 E4M3 linears with E8M0 scales per 32x32 block (weight_block_size);
routed experts FP4 (I8) with E8M0 per 32 along K; compressor and indexer `wk`/`weights_proj`
BF16; norms, routers, Engram q/k weights, Markov and confidence heads, embed and head BF16;
mHC, attention sinks and gate biases F32; Engram tables FP8 rows [rows, head_dim] with E8M0
scales [rows, head_dim / 32].
"""

from __future__ import annotations

from collections.abc import Iterator

from .config import ModelConfig
from .tensors import (
    BF16_LINEAR_DTYPES,
    F32_DTYPES,
    LINEAR_DTYPES,
    SCALE_DTYPES,
    VECTOR_DTYPES,
    TensorSpec,
    _linear,
    _plain,
    block_names,
    experts_block_specs,
    layer_prefix,
    linear_names,
    released_nbytes,
    shared_block_specs,
)

# V4.1 names beyond tensors.BLOCK, under the block prefix.
BLOCK_V41 = {
    "attn.indexer.wk": "attn.indexer.wk",
    "attn.indexer.k_norm": "attn.indexer.k_norm.weight",
    "moe.bias_vl": "ffn.gate.bias_vl",
    "engram": "engram.",
}
COMPRESSOR_V41 = {"wkv": "wkv", "wgate": "wgate", "norm": "norm.weight"}  # no `ape` in V4.1
ENGRAM = {"table": "embed", "wkv": "wkv", "q_weight": "q_weight", "k_weight": "k_weight"}
MODEL_V41 = {"embed": "embed.weight", "norm": "norm.weight", "head": "head"}
IMAGE_DELIMITERS = ("image_start", "image_end", "image_newline")
VISION_BLOCK = {
    "norm1": "norm1.weight",
    "wqkv": "attn.wqkv",
    "wo": "attn.wo",
    "norm2": "norm2.weight",
    "w1": "mlp.w1.weight",  # gate and up fused: [2 * intermediate, hidden]
    "w2": "mlp.w2.weight",
}
# (which stages, name after "mtp.K.", kind, shape from the dims, dtypes); D hidden, V vocab,
# T len(dspark_target_layer_ids), R dspark_markov_rank.
MTP_EXTRAS_V41 = (
    ("first", "main_proj", "linear", lambda D, V, T, R: (D, D * T), LINEAR_DTYPES),
    ("first", "main_norm.weight", "plain", lambda D, V, T, R: (D,), VECTOR_DTYPES),
    ("last", "norm.weight", "plain", lambda D, V, T, R: (D,), VECTOR_DTYPES),
    ("last", "markov_head.embed.weight", "plain", lambda D, V, T, R: (V, R), VECTOR_DTYPES),
    ("last", "markov_head.head.weight", "plain", lambda D, V, T, R: (V, R), VECTOR_DTYPES),
    ("last", "confidence_head.proj.weight", "plain", lambda D, V, T, R: (1, D + R), VECTOR_DTYPES),
)


def engram_names(cfg: ModelConfig, layer: int) -> dict[str, str]:
    """`ENGRAM` under main layer `layer`'s prefix: field -> release name (or linear prefix)."""
    p = layer_prefix(cfg, layer) + BLOCK_V41["engram"]
    return {k: p + v for k, v in ENGRAM.items()}


def engram_table_specs(cfg: ModelConfig, layer: int) -> Iterator[TensorSpec]:
    """The Engram table of `layer`: FP8 rows and their E8M0 scales (read by row, never whole)."""
    e = cfg.engram
    assert e is not None
    weight, scale = linear_names(engram_names(cfg, layer)["table"])
    yield TensorSpec(weight, "table", (e.table_rows(layer), e.head_dim), ("F8_E4M3",), "engram", layer)
    yield TensorSpec(scale, "scale", (), SCALE_DTYPES, "engram", layer, of=weight)


def _engram(cfg: ModelConfig, layer: int, with_tables: bool) -> Iterator[TensorSpec]:
    e = cfg.engram
    assert e is not None
    d, hc = cfg.hidden_size, cfg.hc_mult
    n = engram_names(cfg, layer)
    if with_tables:
        yield from engram_table_specs(cfg, layer)
    yield from _linear(n["wkv"], d * (hc + 1), e.columns * e.head_dim, "trunk", layer)
    yield from _plain(n["q_weight"], (hc, d), VECTOR_DTYPES, "trunk", layer)
    yield from _plain(n["k_weight"], (hc, d), VECTOR_DTYPES, "trunk", layer)


def block_specs_v41(cfg: ModelConfig, layer: int, with_experts: bool = True) -> Iterator[TensorSpec]:
    """Tensors of one V4.1 block (main layer, or DSpark stage n_layers + k); with_experts=False
    leaves out the routed experts and the Engram table (both read by pieces)."""
    n = block_names(cfg, layer)
    x = {k: layer_prefix(cfg, layer) + v for k, v in BLOCK_V41.items()}
    d, hd = cfg.hidden_size, cfg.head_dim
    main = layer < cfg.n_layers
    sh = cfg.shared
    if main and cfg.is_engram_layer(layer):
        yield from _engram(cfg, layer, with_experts)
    yield from shared_block_specs(cfg, n, layer)
    if main and sh is not None and sh.is_kv_source(layer):
        c = {k: n["attn.compressor"] + v for k, v in COMPRESSOR_V41.items()}
        yield from _linear(c["wkv"], hd, d, "trunk", layer, BF16_LINEAR_DTYPES)
        if cfg.ratio(layer) > 1:
            yield from _linear(c["wgate"], hd, d, "trunk", layer, BF16_LINEAR_DTYPES)
        yield from _plain(c["norm"], (hd,), VECTOR_DTYPES, "trunk", layer)
    if main and sh is not None and sh.is_index_source(layer):
        ih, ihd = cfg.index_n_heads, cfg.index_head_dim
        yield from _linear(n["attn.indexer.wq_b"], ih * ihd, cfg.q_lora_rank, "trunk", layer)
        yield from _linear(n["attn.indexer.weights_proj"], ih, d, "trunk", layer, BF16_LINEAR_DTYPES)
        if sh.is_kv_source(layer):
            yield from _linear(x["attn.indexer.wk"], ihd, hd, "trunk", layer, BF16_LINEAR_DTYPES)
            yield from _plain(x["attn.indexer.k_norm"], (ihd,), VECTOR_DTYPES, "trunk", layer)
    e, _ = cfg.experts_of(layer)
    yield from _plain(linear_names(n["moe.gate"])[0], (e, d), VECTOR_DTYPES, "trunk", layer)
    yield from _plain(n["moe.bias"], (e,), F32_DTYPES, "trunk", layer)
    if cfg.vision is not None:
        yield from _plain(x["moe.bias_vl"], (e,), F32_DTYPES, "trunk", layer)
    yield from experts_block_specs(cfg, n, layer, e, with_experts)


def mtp_extra_specs_v41(cfg: ModelConfig, k: int) -> Iterator[TensorSpec]:
    """What DSpark stage mtp.k holds beyond a block, per `MTP_EXTRAS_V41`."""
    ds = cfg.dspark
    assert ds is not None
    layer = cfg.n_layers + k
    p = layer_prefix(cfg, layer)
    dims = (cfg.hidden_size, cfg.vocab_size, len(ds.target_layer_ids), ds.markov_rank)
    for which, name, kind, shape_of, dtypes in MTP_EXTRAS_V41:
        if which == "first" and k != 0 or which == "last" and k != cfg.n_mtp - 1:
            continue
        shape = shape_of(*dims)
        if kind == "linear":
            yield from _linear(p + name, shape[0], shape[1], "trunk", layer, dtypes)
        else:
            yield from _plain(p + name, shape, dtypes, "trunk", layer)


def vision_specs(cfg: ModelConfig) -> Iterator[TensorSpec]:
    """The vision tower, its aligner and the image delimiters (role "vision": not run)."""
    v = cfg.vision
    assert v is not None
    vd, d, bf16 = v.hidden_size, cfg.hidden_size, VECTOR_DTYPES

    def lin(prefix: str, rows: int, cols: int) -> Iterator[TensorSpec]:
        yield from _plain(f"{prefix}.weight", (rows, cols), bf16, "vision", None)
        yield from _plain(f"{prefix}.bias", (rows,), bf16, "vision", None)

    yield from lin("vision.patch_embed.proj", vd, 3 * v.patch_size**2)
    for b in range(v.num_hidden_layers):
        n = {k: f"vision.blocks.{b}.{s}" for k, s in VISION_BLOCK.items()}
        yield from _plain(n["norm1"], (vd,), bf16, "vision", None)
        yield from lin(n["wqkv"], 3 * vd, vd)
        yield from lin(n["wo"], vd, vd)
        yield from _plain(n["norm2"], (vd,), bf16, "vision", None)
        yield from _plain(n["w1"], (2 * v.intermediate_size, vd), bf16, "vision", None)
        yield from _plain(n["w2"], (vd, v.intermediate_size), bf16, "vision", None)
    yield from _plain("vision.norm.weight", (vd,), bf16, "vision", None)
    yield from lin("aligner.w1", d, vd * v.downsample_ratio**2)
    yield from lin("aligner.w2", d, d)
    for name in IMAGE_DELIMITERS:
        yield from _plain(name, (d,), bf16, "vision", None)


def is_vision(name: str) -> bool:
    """A tensor of the vision tower, its aligner or the image delimiters (present, not run)."""
    return name.startswith(("vision.", "aligner.")) or name in IMAGE_DELIMITERS


def model_specs_v41(cfg: ModelConfig, with_experts: bool = True) -> Iterator[TensorSpec]:
    """Every tensor of a V4.1 checkpoint, in model order (with_experts=False: without the
    routed experts and Engram tables)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    yield from _plain(MODEL_V41["embed"], (v, d), VECTOR_DTYPES, "embed", None)
    for layer in range(cfg.n_layers):
        yield from block_specs_v41(cfg, layer, with_experts)
    yield from _plain(MODEL_V41["norm"], (d,), VECTOR_DTYPES, "trunk", None)
    yield from _plain(linear_names(MODEL_V41["head"])[0], (v, d), VECTOR_DTYPES, "head", None)
    for k in range(cfg.n_mtp):
        yield from mtp_extra_specs_v41(cfg, k)
        yield from block_specs_v41(cfg, cfg.n_layers + k, with_experts)
    if cfg.vision is not None:
        yield from vision_specs(cfg)


def engram_nbytes(cfg: ModelConfig) -> int:
    """Bytes of the Engram tables (rows and scales): streamed by row, never resident."""
    return cfg.engram.table_bytes if cfg.engram else 0


def vision_nbytes(cfg: ModelConfig) -> int:
    """Release-dtype bytes of the vision tower, its aligner and the image delimiters (not run)."""
    return sum(released_nbytes(cfg, s) for s in vision_specs(cfg)) if cfg.vision is not None else 0
