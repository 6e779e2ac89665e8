"""Generated DeepSeek-V4 checkpoints: the presets, the released config with a preset's shapes,
and the shard layout (`dsv4stream.synth` writes them).

Presets: `tiny` builds in milliseconds; `demo` has the real vocabulary and experts of ~3.3 MB
so a budget below the checkpoint matters; `flash-experts` has routed experts of exactly
V4-Flash's shape for I/O benches; `tiny-0731` is the 0731 layout (three DSpark stages) at
tiny size; `flash` and `flash-0731` are exact-structure: every tensor of the released
V4-Flash (preview: 46 shards, 69,187 tensors; 0731: 48 shards, 72,317 tensors, 166,878,536,440
bytes) at its real shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import jsonio
from ..checkpoint.config import ModelConfig
from ..checkpoint.spec import model_specs
from ..checkpoint.tensors import TensorSpec
from ..errors import UsageError
from .common import GENERATOR_OPTIONS, REAL_VOCAB

FLASH_CONFIG = Path(__file__).resolve().parents[1] / "v4_flash_config.json"
# The keys DeepSeek-V4-Flash-0731 adds to the preview's config.json (its drafter, unused here),
# as public loaders of the 0731 config report them; the rest of that config is the preview's,
# which is a report, not checked here byte for byte (the official file was not at hand).
DSPARK_0731 = {
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [40, 41, 42],
    "dspark_markov_rank": 256,
}
FLASH_RATIOS = jsonio.read_json(FLASH_CONFIG, "the packaged V4-Flash config")["compress_ratios"]

# Shapes per preset (config keys as released).  "tiny" builds in milliseconds; "demo" has
# experts of ~3.3 MB so a budget below the checkpoint matters; "flash-experts" has routed
# experts of exactly V4-Flash's shape (2048x4096 FP4, 13,369,344 bytes) for I/O benches.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 4,
        "head_dim": 32,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "sliding_window": 8,
        "compress_ratios": [0, 4, 8, 4, 0],
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 2,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "num_hash_layers": 1,
    },
    "demo": {
        "vocab_size": REAL_VOCAB,
        "hidden_size": 1024,
        "num_hidden_layers": 6,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 8,
        "head_dim": 128,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 256,
        "o_groups": 2,
        "o_lora_rank": 256,
        "sliding_window": 64,
        "compress_ratios": [0, 4, 128, 4, 128, 0, 0],
        "index_n_heads": 4,
        "index_head_dim": 64,
        "index_topk": 16,
        "n_routed_experts": 48,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 2048,
        "num_hash_layers": 1,
    },
    "flash-experts": {
        "vocab_size": REAL_VOCAB,
        "hidden_size": 4096,
        "num_hidden_layers": 4,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 4,
        "head_dim": 128,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 256,
        "o_groups": 2,
        "o_lora_rank": 256,
        "sliding_window": 128,
        "compress_ratios": [0, 4, 128, 4, 0],
        "index_n_heads": 4,
        "index_head_dim": 64,
        "index_topk": 64,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 2048,
        "num_hash_layers": 1,
    },
}
# The 0731 layout at tiny size: three DSpark stages (window-only) reading the last three layers.
PRESETS["tiny-0731"] = {
    **PRESETS["tiny"],
    "compress_ratios": [0, 4, 8, 4, 0, 0, 0],
    "dspark_block_size": 5,
    "dspark_noise_token_id": 511,
    "dspark_target_layer_ids": [1, 2, 3],
    "dspark_markov_rank": 8,
}
# Every tensor of the release at its real shape (routed experts as holes unless asked otherwise).
PRESETS["flash"] = {}
PRESETS["flash-0731"] = {**DSPARK_0731, "compress_ratios": [*FLASH_RATIOS, 0, 0]}
EXACT_PRESETS = ("flash", "flash-0731")


def release_config_v4(preset: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """A V4 config.json dict: V4-Flash's fields with a preset's shapes, then `overrides`
    (release field names; generator options are skipped, `scale_fmt` also sets the
    quantization config's)."""
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    d = jsonio.read_json(FLASH_CONFIG, "the packaged V4-Flash config")
    d.update(PRESETS[preset])
    for k, v in overrides.items():
        if k not in GENERATOR_OPTIONS:
            d[k] = v
    if "scale_fmt" in overrides:
        d["quantization_config"] = dict(d["quantization_config"], scale_fmt=overrides["scale_fmt"])
    return d


def shard_groups(cfg: ModelConfig, ends_alone: bool = False) -> list[list[TensorSpec]]:
    """One shard per main layer and per MTP block; the embed in the first layer's shard and the
    head's tensors in the last's, or (ends_alone, as the release: 46 / 48 shards) each alone."""
    n = cfg.n_layers + cfg.n_mtp
    groups: list[list[TensorSpec]] = [[] for _ in range(n + (2 if ends_alone else 0))]
    for s in model_specs(cfg):
        if s.layer is None:
            if ends_alone:
                groups[0 if s.role == "embed" else n + 1].append(s)
            else:
                groups[0 if s.role == "embed" else cfg.n_layers - 1].append(s)
        else:
            groups[s.layer + (1 if ends_alone else 0)].append(s)
    return groups
