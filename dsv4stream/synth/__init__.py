"""Generated checkpoints in exactly the official release format, for tests and benchmarks.

Owns: a release-schema `config.json` for a chosen size, random weights for every tensor in
`checkpoint.spec.model_specs` stored with the release dtypes, and shards written with the
`safetensors` library, which orders tensors as the release does (by dtype, then name). That
order is what puts an expert's three scale tensors in one run and its three weight tensors
in another run far away, at offsets that are not 4096-aligned; tests assert it.

Exact-structure checkpoints (presets `flash`, `flash-0731`) have every tensor of the released
V4-Flash (preview: 46 shards, 69,187 tensors; 0731: 48 shards, 72,317 tensors, 166,878,536,440
bytes) with routed experts as sparse-file holes (`sparse_experts`): the index and headers are
the release's, the experts read as zeros and take no disk, so a full-size dry run (validation,
planner, trunk ring, real-dimension attention and head, peak RSS) fits on a laptop.

Weights are random: text generated from them is random too. Tests, benches and tools
import this package; nothing on a run's path does.

Here: the family switch (`release_config`, `make_checkpoint`, `all_presets`). `v4` / `v41`:
each family's presets, released config and shard layout; `common`: the random weights and
the sparse safetensors writer both use.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from ..checkpoint.config import V41, ModelConfig
from ..errors import UsageError
from . import v4, v41
from .common import GENERATOR_OPTIONS, REAL_VOCAB, Hole, RandomWeights, save_sparse
from .v4 import EXACT_PRESETS, FLASH_CONFIG, PRESETS, release_config_v4
from .v41 import EXACT_PRESETS_V41, PRESETS_V41, engram_class_count, release_config_v41, small_tokenizer_json

__all__ = [
    "EXACT_PRESETS",
    "EXACT_PRESETS_V41",
    "FLASH_CONFIG",
    "GENERATOR_OPTIONS",
    "PRESETS",
    "PRESETS_V41",
    "REAL_VOCAB",
    "all_presets",
    "make_checkpoint",
    "release_config",
    "v4",
    "v41",
]


def release_config(preset: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """A config.json dict in the release schema: V4-Flash's fields with a preset's shapes (a
    V4.1 preset: V4.1-Flash's, see `v41.release_config_v41`)."""
    if preset in PRESETS_V41:
        return release_config_v41(preset, {k: v for k, v in overrides.items() if k not in GENERATOR_OPTIONS})
    return release_config_v4(preset, overrides)


def all_presets() -> list[str]:
    """Every preset name, V4 then V4.1."""
    return [*PRESETS, *PRESETS_V41]


def make_checkpoint(out_dir: str | os.PathLike, preset: str = "tiny", seed: int = 0, **overrides: Any) -> Path:
    """Write a complete checkpoint directory; returns its path.

    Config overrides use release field names (e.g. compress_ratios=[...], swiglu_limit=1.0).
    Generator options: scale_fmt "ue8m0" (release) | "float" (F32 scales); dense_dtype
    "fp8" (release) | "bf16" | "f32"; compressor_dtype "bf16" (release) | "fp8";
    route_skew (power-law strength of expert popularity through the gate bias and the hash
    table, 0 = uniform); tokenizer (copy the real V4 tokenizer; default when vocab is the
    real one); expert_gain (multiplies expert weights, to make the SwiGLU clamp bite);
    sparse_experts (routed experts as sparse-file holes that read as zeros; default for the
    exact-structure presets, which also shard as the release does: embed and head alone);
    output_gain_log2 (an integer k: the projections whose outputs join the residual streams,
    attn.wo_b, every w2 and V4.1's engram.wkv, get their scales times 2^k, exactly; k < 0 damps
    what each sublayer adds, so random weights stay in the range trained weights keep).
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out}: already exists and is not empty; choose a new directory")
    cfg_dict = release_config(preset, **overrides)
    small_tok = None
    if preset in PRESETS_V41:
        if "scale_fmt" in overrides:
            cfg_dict["quantization_config"] = dict(cfg_dict["quantization_config"], scale_fmt=overrides["scale_fmt"])
        text = cfg_dict["text_config"]
        if text["vocab_size"] != REAL_VOCAB and overrides.get("tokenizer") is not False:
            small_tok = small_tokenizer_json(text["vocab_size"], seed)
            if text.get("engram_layer_ids") and "engram_compressed_vocab_size" not in overrides:
                text["engram_compressed_vocab_size"] = engram_class_count(small_tok)
    cfg = ModelConfig.from_dict(cfg_dict, source=f"preset {preset}")
    opts = {k: overrides.get(k) for k in GENERATOR_OPTIONS}
    # Provenance for benches (which routing a hit rate was measured on); loaders ignore it.
    cfg_dict["dsv4stream_generator"] = {
        "preset": preset,
        "seed": seed,
        **{k: v for k, v in opts.items() if v is not None},
    }
    tok = opts["tokenizer"] if opts["tokenizer"] is not None else cfg.vocab_size == REAL_VOCAB
    exact = preset in EXACT_PRESETS or preset in EXACT_PRESETS_V41
    if opts["sparse_experts"] is None:
        opts["sparse_experts"] = exact
    rng = np.random.default_rng(seed)
    gen = RandomWeights(cfg, rng, opts, codes=preset in EXACT_PRESETS_V41)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is ordinary shared data
    try:
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
        groups = (v41 if cfg.family == V41 else v4).shard_groups(cfg, ends_alone=exact)
        n = len(groups)
        weight_map: dict[str, str] = {}
        total = 0
        for i, names in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            tensors = {s.name: gen.tensor(s) for s in names}
            tensors = {k: v for k, v in tensors.items() if v is not None}
            if any(isinstance(v, Hole) for v in tensors.values()) or any(".engram." in k for k in tensors):
                save_sparse(tensors, tmp / fname, keep_order=any(".engram." in k for k in tensors))
            else:
                safetensors.numpy.save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            (tmp / fname).chmod(0o644)  # safetensors creates it 0600; the other files are 0644
            for k, v in tensors.items():
                weight_map[k] = fname
                total += v.nbytes
            del tensors
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
        if small_tok is not None:
            (tmp / "tokenizer.json").write_text(small_tok, encoding="utf-8")
        elif tok:
            _copy_tokenizer(tmp, cfg)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _copy_tokenizer(dst: Path, cfg: ModelConfig) -> None:
    from ..text import tokenizer

    # V4.1's tokenizer.json is V4's with 9 added tokens changed (text.vocab derives it)
    if cfg.family == V41:
        tokenizer.write_tokenizer_files(dst, family="v41")
        return
    for src in tokenizer.real_tokenizer_files():
        shutil.copyfile(src, dst / src.name)
