"""Generated DeepSeek-V4.1 checkpoints: configs, layer plans and shard layout (`dsv4stream.synth`
writes them).

Owns: the V4.1 presets (`PRESETS_V41`), the released config with a preset's shapes and the
caller's overrides (`release_config_v41`), a consistent layer plan for any depth
(`layer_plan`: which layers are window-only, ratio 2, ratio 1, kv / index / candidate
sources, Engram layers, DSpark targets), Engram table sizes that match their bucket primes
(`engram_rows`), and the shards (`shard_groups`).

Presets:
- `tiny-v41`: builds in well under a second with the release's structure at small dims:
  window-only layers, ratio-2 kv sources with `compressor.wgate`, a ratio-1 kv source without
  it that is also the candidate source, index-only sources, readers of each, an Engram layer
  that is also a kv source (as layer 14 is), small Engram tables, three DSpark stages with
  their own experts, a two-block vision tower, FP8 32x32 and FP4 per 32.
- `tiny-v41-long`: the same plan with a short window and small index_topk and candidate
  pool, so a prompt of a few hundred tokens makes the indexer and the candidate blocks select.
- `demo-v41`: the real vocabulary (and a tokenizer), small dims.
- `flash-v41`: every tensor of DeepSeek-V4.1-Flash at its real shape (96,085 tensors,
  510,286,023,000 bytes in 48 shards); routed experts and Engram tables as sparse-file holes,
  the dense trunk real (about 11.5 GB on disk).

Tiny presets (vocabulary below the real one) carry a small tokenizer.json of their own
(`small_tokenizer_json`: specials, texts whose Engram classes collapse, random words) and
their `engram_compressed_vocab_size` is its class count, so the Engram class map is a real
one, never an assumed identity.

Shards as the release lays them out (48 for the real config): one per main layer and per
DSpark stage, the embedding and the head (with the final norm) each alone, the vision tower
in one, and each Engram layer's module (table rows, then the table's scales far after them,
then wkv, q_weight, k_weight) alone in its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .. import jsonio
from ..checkpoint.config import ModelConfig
from ..checkpoint.spec import model_specs
from ..checkpoint.tensors import TensorSpec
from ..engram.layout import table_rows
from ..errors import UsageError
from .common import REAL_VOCAB

V41_CONFIG = Path(__file__).resolve().parents[1] / "v41_flash_config.json"

# Keys of the released config.json outside text_config.
TOP_LEVEL = (
    "architectures",
    "bos_token_id",
    "dtype",
    "eos_token_id",
    "pad_token_id",
    "image_token_id",
    "quantization_config",
    "vision_config",
    "transformers_version",
)


def layer_plan(
    n_layers: int,
    window: int = 2,
    encoder: int | None = None,
    kv_group: int = 6,
    index_every: int = 4,
    mtp: int = 3,
    targets: int = 3,
) -> dict[str, Any]:
    """A consistent V4.1 layer plan, as text_config keys, for `n_layers` main layers.

    Layers 0..window-1 are window-only; the next `encoder` layers (default: up to half the
    depth, the causal encoder) are
    ratio 2 with a kv source at the start of every `kv_group`; the remaining layers are ratio 1
    with one kv source (the first, also the candidate source) and an index source every
    `index_every`; Engram on layer 1 and the last ratio-2 kv source; DSpark targets the last
    `targets` layers, `mtp` stages. layer_plan(40) is the release's plan.
    """
    if window < 0 or n_layers < window + 2:
        raise UsageError(f"a V4.1 layer plan needs at least {window + 2} layers (window-only, ratio 2, ratio 1)")
    rest = n_layers - window
    enc = max(1, n_layers // 2 - window) if encoder is None else encoder
    if not 1 <= enc < rest or kv_group < 1 or index_every < 1:
        raise UsageError(f"layer plan: encoder layers must be 1..{rest - 1} and the groups at least 1")
    ratios = [0] * window + [2] * enc + [1] * (rest - enc) + [0] * mtp
    kv = list(range(window, window + enc, kv_group))
    first1 = window + enc
    kv.append(first1)
    index = kv[:-1] + list(range(first1, n_layers, index_every))
    engram = sorted({min(1, n_layers - 1), kv[-2]})
    t = min(targets, n_layers)
    return {
        "num_hidden_layers": n_layers,
        "compress_ratios": ratios,
        "kv_source_layer_ids": kv,
        "index_source_layer_ids": index,
        "candidate_source_layer_id": first1,
        "engram_layer_ids": engram,
        "num_nextn_predict_layers": mtp,
        "dspark_target_layer_ids": list(range(n_layers - t, n_layers)),
    }


def engram_rows(vocab_size: int, layers: int, max_ngram_size: int, n_heads: int) -> list[int]:
    """`engram_num_embeddings` that matches the tables' bucket primes."""
    return list(table_rows(vocab_size, layers, max_ngram_size, n_heads))


_TINY_TEXT = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 8,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 4,
    "candidate_topk_blocks": 3,  # the pool holds at least (3 - 1) x 2 + 1 = 5 >= index_topk rows
    "candidate_block_size": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "engram_vocab_size": 40,
    "engram_max_ngram_size": 4,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_compressed_vocab_size": 512,
    "dspark_noise_token_id": 499,
    "dspark_markov_rank": 8,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
    **layer_plan(10, window=2, encoder=4, kv_group=2, index_every=2),
}
_TINY_VISION = {
    "model_type": "deepseek_v41_vision",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 48,
    "patch_size": 2,
    "rope_theta": 10000,
    "downsample_ratio": 2,
    "max_image_tokens": 16,
    "min_pixels": 64,
    "max_wh_ratio": None,
}

# Per preset: text_config keys, and top-level keys (vision_config, token ids).
PRESETS_V41: dict[str, dict[str, Any]] = {
    "tiny-v41": {"text": _TINY_TEXT, "top": {"image_token_id": 500, "vision_config": _TINY_VISION}},
    "tiny-v41-long": {
        "text": {**_TINY_TEXT, "sliding_window": 4, "index_topk": 3, "candidate_topk_blocks": 3},
        "top": {"image_token_id": 500, "vision_config": _TINY_VISION},
    },
    "demo-v41": {
        "text": {
            **_TINY_TEXT,
            "vocab_size": REAL_VOCAB,
            "hidden_size": 512,
            "num_attention_heads": 8,
            "head_dim": 128,
            "qk_rope_head_dim": 64,
            "q_lora_rank": 128,
            "o_groups": 2,
            "o_lora_rank": 128,
            "sliding_window": 64,
            "index_n_heads": 4,
            "index_head_dim": 128,
            "index_topk": 32,
            "candidate_topk_blocks": 16,
            "candidate_block_size": 8,
            "n_routed_experts": 32,
            "num_experts_per_tok": 6,
            "moe_intermediate_size": 512,
            "engram_vocab_size": 4000,
            "engram_head_dim": 64,
            "engram_compressed_vocab_size": 99092,
            "dspark_noise_token_id": 128799,
            "dspark_markov_rank": 32,
            "dspark_n_routed_experts": 16,
            "dspark_num_experts_per_tok": 3,
        },
        "top": {
            "image_token_id": 129264,
            "vision_config": {**_TINY_VISION, "hidden_size": 64, "num_attention_heads": 4},
        },
    },
    "flash-v41": {"text": {}, "top": {}},
}
EXACT_PRESETS_V41 = ("flash-v41",)


def release_config_v41(preset: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """A V4.1 config.json dict: the release's, a preset's shapes, then `overrides` (text_config
    keys, or the top-level keys in TOP_LEVEL; vision_config None drops the tower). When the
    preset or the overrides change the Engram shape and not `engram_num_embeddings`, the table
    rows are derived from the bucket primes."""
    if preset not in PRESETS_V41:
        raise UsageError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS_V41)}")
    d = jsonio.read_json(V41_CONFIG, "the packaged V4.1-Flash config")
    p = PRESETS_V41[preset]
    text = {**d["text_config"], **p["text"]}
    top = {**p["top"]}
    for k, v in overrides.items():
        (top if k in TOP_LEVEL else text)[k] = v
    for k, v in top.items():
        d[k] = v
    if d.get("vision_config") is None:
        d.pop("vision_config", None)
    engram_keys = ("engram_vocab_size", "engram_layer_ids", "engram_max_ngram_size", "engram_n_heads")
    changed = any(k in p["text"] or k in overrides for k in engram_keys)
    if changed and "engram_num_embeddings" not in overrides and text.get("engram_layer_ids"):
        text["engram_num_embeddings"] = engram_rows(
            text["engram_vocab_size"],
            len(text["engram_layer_ids"]),
            text["engram_max_ngram_size"],
            text["engram_n_heads"],
        )
    d["text_config"] = text
    return d


SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")  # ids 0, 1, 2 as in the release
# Token texts whose Engram classes merge (case, accents, compatibility forms, runs of spaces) or
# that hold part of a UTF-8 character (keyed by their raw token, never merged).
CLASS_PROBES: tuple[str | bytes, ...] = (
    "the", " the", "The", " THE", "naïve", "naive", "NAÏVE", "u\u0308", "ü", "\ufb02", "fl", " ", "   ",
    "\t", "\r\n", " \t ", "\uff42", "b", "B", "\u2163", "IV", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xe2",
)  # fmt: skip


def small_tokenizer_json(vocab_size: int, seed: int) -> str:
    """A byte-level word tokenizer with exactly `vocab_size` ids: SPECIALS, CLASS_PROBES, then
    random short words of mixed case (some collide after normalisation, most do not)."""
    import tokenizers
    from tokenizers import AddedToken, decoders, models

    byte_char = _byte_chars()
    rng = np.random.default_rng(seed)
    words = [w if isinstance(w, bytes) else w.encode() for w in CLASS_PROBES]
    letters = list("xyzXYZ wW")
    seen = set(words)
    while len(words) < vocab_size - len(SPECIALS):
        w = "".join(rng.choice(letters, size=int(rng.integers(1, 5)))).encode()
        if w not in seen:
            seen.add(w)
            words.append(w)
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for w in words[: vocab_size - len(SPECIALS)]:
        vocab.setdefault("".join(byte_char[b] for b in w), len(vocab))
    if len(vocab) != vocab_size:
        raise UsageError(f"a small tokenizer needs a vocabulary of at least {len(SPECIALS) + len(CLASS_PROBES)} ids")
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[2]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok.to_str()


def _byte_chars() -> dict[int, str]:
    """The byte-level tokenizers' printable stand-in for each byte (printable Latin-1 bytes stand
    for themselves, the rest are moved past U+0100 in order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def engram_class_count(tokenizer_json: str) -> int:
    """Classes of the Engram compressed vocabulary of a tokenizer.json (its config value)."""
    import tokenizers

    from ..engram.vocab import token_classes

    return token_classes(tokenizers.Tokenizer.from_str(tokenizer_json)).n_classes


def shard_groups(cfg: ModelConfig, ends_alone: bool) -> list[list[TensorSpec]]:
    """Shards in file order: [embed alone] + main layers + DSpark stages + [head and final
    norm alone] + [vision tower] + each Engram module alone. Without ends_alone the embedding
    joins the first layer's shard and the head the last layer's."""
    n, n_mtp = cfg.n_layers, cfg.n_mtp
    blocks: list[list[TensorSpec]] = [[] for _ in range(n + n_mtp)]
    embed: list[TensorSpec] = []
    head: list[TensorSpec] = []
    vision: list[TensorSpec] = []
    engram: dict[int, list[TensorSpec]] = {}
    for s in model_specs(cfg):
        if s.role == "vision":
            vision.append(s)
        elif ".engram." in s.name:
            engram.setdefault(s.layer, []).append(s)
        elif s.layer is not None:
            blocks[s.layer].append(s)
        else:
            (embed if s.role == "embed" else head).append(s)
    modules = [_engram_order(engram[k]) for k in sorted(engram)]
    if ends_alone:
        return [g for g in [embed, *blocks, head, vision, *modules] if g]
    blocks[0] = embed + blocks[0]
    blocks[n - 1] += head
    return [g for g in [*blocks, vision, *modules] if g]


def _engram_order(specs: list[TensorSpec]) -> list[TensorSpec]:
    """The table's rows first, its scale array right after them (a table's length away from
    each row), then the module's small tensors."""
    table = [s for s in specs if s.kind == "table"]
    scales = [s for s in specs if s.kind == "scale" and s.of in {t.name for t in table}]
    rest = [s for s in specs if s not in table and s not in scales]
    return table + scales + rest
