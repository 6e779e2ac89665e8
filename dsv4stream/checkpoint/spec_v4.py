"""Every tensor of a DeepSeek-V4 checkpoint, with the dtypes and shapes the config implies.

Owns: V4's part of the name table (`COMPRESSOR`, `MTP_EXTRAS`: names V4.1 does not have) and
the list of expected tensors (`model_specs_v4`, `block_specs_v4`), in the `TensorSpec` terms
of `tensors`; `spec` dispatches here for `family == "v4"`.

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

from collections.abc import Callable, Iterator

from .config import CSA, DSPARK, PREVIEW, ModelConfig
from .tensors import (
    BF16_LINEAR_DTYPES,
    F32_DTYPES,
    LINEAR_DTYPES,
    MODEL,
    VECTOR_DTYPES,
    TensorSpec,
    _linear,
    _plain,
    block_names,
    experts_block_specs,
    hc_names,
    layer_prefix,
    linear_names,
    shared_block_specs,
)

# CompressorWeights fields -> names after a compressor's prefix (V4.1's: spec_v41.COMPRESSOR_V41).
COMPRESSOR = {"wkv": "wkv", "wgate": "wgate", "ape": "ape", "norm": "norm.weight"}


def _compressor(cfg, prefix: str, layer: int, ratio: int, dim: int) -> Iterator[TensorSpec]:
    coff = 2 if ratio == 4 else 1  # ratio-4 windows overlap: two halves per slot
    d = cfg.hidden_size
    c = {k: prefix + v for k, v in COMPRESSOR.items()}
    yield from _linear(c["wkv"], coff * dim, d, "trunk", layer, BF16_LINEAR_DTYPES)
    yield from _linear(c["wgate"], coff * dim, d, "trunk", layer, BF16_LINEAR_DTYPES)
    yield from _plain(c["ape"], (ratio, coff * dim), F32_DTYPES, "trunk", layer)
    yield from _plain(c["norm"], (dim,), VECTOR_DTYPES, "trunk", layer)


def block_specs_v4(cfg: ModelConfig, layer: int, with_experts: bool = True) -> Iterator[TensorSpec]:
    """Tensors of one V4 block (main layer or MTP block). with_experts=False: the dense trunk
    only, without the routed experts (read by pieces)."""
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


# Tensors each layout adds to its mtp.K blocks beyond a transformer block:
# (which stages, name after "mtp.K.", kind, shape from the dims below, dtypes).
# D hidden, V vocab, H hc_mult, T len(dspark_target_layer_ids), R dspark_markov_rank.
# Preview: DeepSeek's inference/model.py MTPBlock. 0731: the tensor names and shapes
# reported for the published index by public loaders (main_proj FP8 [4096, 12288] + scale,
# markov_w1/w2 BF16 [129280, 256], confidence_head.proj BF16 [1, 4352] = [1, D + R]); the
# main_norm / norm widths (D) and the hc_head / Markov / confidence dtypes are inferred from
# the DSpark code that reads them and from the index's byte total (tests/test_releases.py).
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


def model_specs_v4(cfg: ModelConfig, with_experts: bool = True) -> Iterator[TensorSpec]:
    """Every tensor of a V4 checkpoint, in model order (with_experts=False: without the routed
    experts)."""
    d, v, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    yield from _plain(MODEL["embed"], (v, d), VECTOR_DTYPES, "embed", None)
    for layer in range(cfg.n_layers):
        yield from block_specs_v4(cfg, layer, with_experts)
    yield from _plain(MODEL["norm"], (d,), VECTOR_DTYPES, "trunk", None)
    fn, base, scale = hc_names(MODEL["hc_head"])
    yield from _plain(fn, (hc, hc * d), F32_DTYPES, "trunk", None)
    yield from _plain(base, (hc,), F32_DTYPES, "trunk", None)
    yield from _plain(scale, (1,), F32_DTYPES, "trunk", None)
    yield from _plain(linear_names(MODEL["head"])[0], (v, d), VECTOR_DTYPES, "head", None)
    for k in range(cfg.n_mtp):
        yield from mtp_extra_specs(cfg, k)
        yield from block_specs_v4(cfg, cfg.n_layers + k, with_experts)
