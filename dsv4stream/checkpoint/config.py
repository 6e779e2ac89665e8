"""The model's shape, read once from the checkpoint's `config.json`.

Owns: reading config.json (through `jsonio`), validating it against the declared schema
(`schema`: every key, type and range) and the relations between fields (here), the frozen
`ModelConfig` the rest of the code reads as typed fields, the layer kinds derived from
`compress_ratios`, and the byte arithmetic that planning needs (expert bytes, working set
per pass). It reads no weights.

Two families (`ModelConfig.family`):
- "v4" — DeepSeek-V4 (preview, 0731, Pro): one flat object, `model_type: deepseek_v4`.
  `compress_ratios` holds one entry per main layer plus one per block under `mtp.*`: 0 =
  window-only attention, 4 = compressed sparse attention (with the lightning indexer), any
  other positive ratio = heavily compressed attention (the release uses 128; tiny test
  models use 8 or 16). Two layouts of the `mtp.*` blocks are released (see `LAYOUTS`): the
  May preview's one MTP block (`num_nextn_predict_layers` blocks) and DeepSeek-V4-Flash-0731's
  DSpark drafter, announced by the `dspark_*` keys, whose stages are the compress_ratios
  entries past the main layers (three in 0731, while `num_nextn_predict_layers` stays 1).
- "v41" — DeepSeek-V4.1 (`model_type: deepseek_v41`): the text model under `text_config`,
  the vision tower under `vision_config`, `expert_dtype` inside `quantization_config`. Ratio
  0 = window only; a positive ratio (2 or 1 in the release) means the layer reads the
  compressed cache of the latest `kv_source_layer_ids` layer at or before it (`SharedAttention`):
  only those layers own a compressor, only `index_source_layer_ids` own an indexer. Engram
  tables on `engram_layer_ids` (`EngramConfig`), a DSpark drafter of
  `num_nextn_predict_layers` stages under `mtp.*` (validated, not run), and a vision tower
  (`VisionConfig`, validated, not run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .. import jsonio
from ..engram import layout as engram_layout
from ..errors import ConfigError
from .schema import SCHEMAS, ConfigV4, ConfigV41, validation_problems

WINDOW, CSA, HCA, SHARED = "window", "csa", "hca", "shared"
PREVIEW, DSPARK, DSPARK_V41 = "mtp", "dspark", "dspark-v41"
V4, V41 = "v4", "v41"
# What each layout of the `mtp.*` blocks is called where a person reads it.
LAYOUTS = {
    PREVIEW: "the preview layout (one MTP block under mtp.0)",
    DSPARK: "the 0731 layout (a DSpark drafter under mtp.*)",
    DSPARK_V41: "the V4.1 layout (a DSpark drafter under mtp.*)",
    None: "no mtp.* blocks",
}
SUPPORTED_MODEL_TYPE = "deepseek_v4"
SUPPORTED_MODEL_TYPES = {"deepseek_v4": "DeepSeek-V4", "deepseek_v41": "DeepSeek-V4.1"}
# Architectures people point dsv4 at that share names with V4 but not its tensors. Only the
# model_type string is relied on here.
UNSUPPORTED_MODEL_TYPES = {"deepseek_v3": "DeepSeek-V3", "deepseek_v32": "DeepSeek-V3.2"}
SCALE_FMTS = ("ue8m0", "float")  # "float": null in config.json, F32 scales


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters; applied only on compressed layers (with compress_rope_theta)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class DSparkConfig:
    """The drafter's keys (`dspark_*`), kept so a drafter can be added later; not run today.

    stages: blocks under mtp.0..stages-1 (compress_ratios entries past the main layers);
    target_layer_ids: main layers whose outputs the first stage reads (concatenated, so its
    `main_proj` is [hidden, hidden * len(target_layer_ids)]); markov_rank: width of the Markov
    head; n_routed_experts / num_experts_per_tok: the stages' own MoE (V4.1: 128, top-3),
    None where the drafter uses the main model's.
    """

    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    stages: int
    n_routed_experts: int | None = None
    num_experts_per_tok: int | None = None


@dataclass(frozen=True)
class SharedAttention:
    """V4.1's shared compressed attention (`kv_source_layer_ids` and the rest).

    kv_sources own a compressor (softmax-gated pooling at ratio > 1, per-token norm(wkv x) at
    ratio 1) and the index keys (`indexer.wk`, `indexer.k_norm`); index_sources own an indexer
    query (`indexer.wq_b`, `indexer.weights_proj`); every other compressed layer reads the latest
    source's cache and top-k. candidate_source (-1: none) keeps the best `candidate_topk_blocks`
    blocks of `candidate_block_size` compressed positions; the index sources after it choose inside.
    """

    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    candidate_source: int
    candidate_topk_blocks: int
    candidate_block_size: int

    def is_kv_source(self, layer: int) -> bool:
        return layer in self.kv_sources

    def is_index_source(self, layer: int) -> bool:
        return layer in self.index_sources

    def kv_source_of(self, layer: int) -> int:
        """The kv source whose compressed cache main layer `layer` reads (itself if it is one)."""
        return max(s for s in self.kv_sources if s <= layer)

    def index_source_of(self, layer: int) -> int:
        """The index source whose top-k main layer `layer` uses (itself if it is one)."""
        return max(s for s in self.index_sources if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        """An index source after the candidate source: it scores only inside the candidate blocks."""
        return 0 <= self.candidate_source < layer and layer in self.index_sources


@dataclass(frozen=True)
class EngramConfig:
    """V4.1's Engram n-gram tables: one per layer in `layer_ids`, `rows[i]` rows of `head_dim`
    FP8 values with one E8M0 scale per 32 columns. Before each such layer, every token picks
    `columns` rows ((max_ngram_size - 1) n-gram sizes x n_heads) by hashing the compressed ids of
    itself and the tokens before it (`compressed_vocab_size` classes; `pad_token_id` before the
    start)."""

    layer_ids: tuple[int, ...]
    rows: tuple[int, ...]
    max_ngram_size: int
    vocab_size: int  # where the bucket-prime search starts
    n_heads: int
    head_dim: int
    pad_token_id: int
    compressed_vocab_size: int

    @property
    def columns(self) -> int:
        """Rows one token reads per Engram layer (24 in the release)."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def row_bytes(self) -> int:
        """One row as stored: head_dim FP8 bytes plus head_dim / 32 E8M0 scale bytes (264)."""
        return self.head_dim + self.head_dim // 32

    def table_rows(self, layer: int) -> int:
        return self.rows[self.layer_ids.index(layer)]

    @property
    def table_bytes(self) -> int:
        """All tables, rows and scales."""
        return sum(self.rows) * self.row_bytes

    def primes(self) -> tuple[tuple[int, ...], ...]:
        """Per Engram layer, each column's bucket prime (see `engram.layout`)."""
        return engram_layout.column_primes(self.vocab_size, len(self.layer_ids), self.max_ngram_size, self.n_heads)


@dataclass(frozen=True)
class VisionConfig:
    """V4.1's vision tower (`vision.*`, `aligner.*`, `image_*`): validated, not run."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: float | None


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    compress_rope_theta: float
    rope_theta: float
    rms_norm_eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rope_scaling: RopeScaling | None = None
    num_nextn_predict_layers: int = 0
    norm_topk_prob: bool = True
    topk_method: str = "noaux_tc"
    expert_dtype: str = "fp4"
    fp8_block: tuple[int, int] = (128, 128)
    scale_fmt: str = "ue8m0"
    bos_token_id: int = 0
    eos_token_id: int = 1
    max_position_embeddings: int = 1 << 20
    model_type: str = SUPPORTED_MODEL_TYPE
    dspark: DSparkConfig | None = None
    family: str = V4
    pad_token_id: int | None = None
    image_token_id: int | None = None
    shared: SharedAttention | None = None  # V4.1
    engram: EngramConfig | None = None  # V4.1
    vision: VisionConfig | None = None  # V4.1
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        p = Path(path)
        d = jsonio.read_json(
            p,
            "config.json",
            ConfigError,
            max_bytes=jsonio.CONFIG_MAX,
            fix="put the checkpoint's own config.json there (re-download it)",
        )
        return cls.from_dict(d, source=str(p))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> ModelConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object at the top level — fix config.json")
        schema = _schema_for(d, source)
        try:
            c = schema.model_validate(d)
        except ValidationError as e:
            raise _refusal(source, validation_problems(e)) from None
        except RecursionError:  # a Python dict nested past the interpreter's stack (a file cannot be)
            raise ConfigError(f"{source}: nested too deeply — fix config.json") from None
        problems: list[str] = []
        kw = _from_v41(c, problems) if isinstance(c, ConfigV41) else _from_v4(c, problems)
        if problems:
            raise _refusal(source, problems)
        return cls(**kw, raw=dict(d))

    # ---- layer structure ------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def n_mtp(self) -> int:
        """Blocks under mtp.*: the preview's MTP blocks, or the DSpark drafter's stages."""
        return self.dspark.stages if self.dspark else self.num_nextn_predict_layers

    @property
    def layout(self) -> str | None:
        """Which layout the mtp.* blocks follow: PREVIEW, DSPARK, DSPARK_V41, or None (no blocks)."""
        if self.dspark:
            return DSPARK_V41 if self.family == V41 else DSPARK
        return PREVIEW if self.num_nextn_predict_layers else None

    def ratio(self, layer: int) -> int:
        """Compress ratio of main layer `layer`, or of MTP layer k at index n_layers + k."""
        return self.compress_ratios[layer]

    def layer_kind(self, layer: int) -> str:
        """V4: WINDOW, CSA (ratio 4) or HCA. V4.1: WINDOW, or SHARED (reads a source's cache)."""
        r = self.compress_ratios[layer]
        if r == 0:
            return WINDOW
        if self.family == V41:
            return SHARED
        return CSA if r == 4 else HCA

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(self.layer_kind(i) for i in range(self.n_layers))

    def is_hash_layer(self, layer: int) -> bool:
        """Hash-routed MoE: the first num_hash_layers main layers (never the MTP block; none in V4.1)."""
        return layer < min(self.num_hash_layers, self.n_layers)

    def is_engram_layer(self, layer: int) -> bool:
        return self.engram is not None and layer in self.engram.layer_ids

    def experts_of(self, layer: int) -> tuple[int, int]:
        """(routed experts, experts per token) of block `layer` (main, or n_layers + k for mtp.k)."""
        if layer >= self.n_layers and self.dspark and self.dspark.n_routed_experts:
            return self.dspark.n_routed_experts, self.dspark.num_experts_per_tok or self.num_experts_per_tok
        return self.n_routed_experts, self.num_experts_per_tok

    # ---- byte arithmetic for planning ---------------------------------------------
    def _fp4_bytes(self, rows: int, cols: int) -> int:
        # packed E2M1 (two per byte) + one E8M0 byte per 32 inputs
        return rows * cols // 2 + rows * (cols // 32)

    def _fp8_bytes(self, rows: int, cols: int) -> int:
        br, bc = self.fp8_block
        scale_item = 1 if self.scale_fmt == "ue8m0" else 4
        return rows * cols + math.ceil(rows / br) * math.ceil(cols / bc) * scale_item

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert on disk: w1, w2, w3 weights plus their scales."""
        d, m = self.hidden_size, self.moe_intermediate_size
        f = self._fp4_bytes if self.expert_dtype == "fp4" else self._fp8_bytes
        return f(m, d) + f(d, m) + f(m, d)

    @property
    def tid2eid_bytes(self) -> int:
        """int64 expert tables of the hash layers, kept resident so routing never waits on a layer."""
        return min(self.num_hash_layers, self.n_layers) * self.vocab_size * self.num_experts_per_tok * 8

    @property
    def working_set_experts(self) -> int:
        """Routed experts one forward pass touches (main layers only)."""
        return self.n_layers * self.num_experts_per_tok

    @property
    def working_set_bytes(self) -> int:
        return self.working_set_experts * self.expert_bytes

    @property
    def total_expert_bytes(self) -> int:
        """Every routed expert of the checkpoint, the mtp.* blocks' included."""
        n = self.n_layers * self.n_routed_experts
        n += sum(self.experts_of(self.n_layers + k)[0] for k in range(self.n_mtp))
        return n * self.expert_bytes

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.eos_token_id,)


def _refusal(source: str, problems: list[str]) -> ConfigError:
    return ConfigError(f"{source}: " + "; ".join(problems) + " — fix config.json (it must be the released schema)")


def _schema_for(d: dict[str, Any], source: str) -> type:
    """Refuse another architecture before its fields are read as ours (one clear line)."""
    if "model_type" not in d:
        raise ConfigError(
            f"{source}: no 'model_type'; config.json must say which model it describes"
            f" ({' or '.join(repr(k) for k in SUPPORTED_MODEL_TYPES)}) — use the checkpoint's own config.json"
        )
    mt = d["model_type"]
    if mt == "deepseek_v41" and "text_config" not in d:
        raise ConfigError(
            f"{source}: a DeepSeek-V4.1 config.json nests the text model under 'text_config' (this one is flat,"
            " as V4's is) — use the checkpoint's own config.json"
        )
    if isinstance(mt, str) and mt in SCHEMAS:
        return SCHEMAS[mt]
    name = UNSUPPORTED_MODEL_TYPES.get(mt) if isinstance(mt, str) else None
    what = f"{name} (model_type {mt!r})" if name else f"model_type {mt!r}"
    raise ConfigError(
        f"{source}: {what} is not supported; dsv4stream runs DeepSeek-V4 (model_type 'deepseek_v4':"
        " V4-Flash, V4-Flash-0731, V4-Pro) and DeepSeek-V4.1 (model_type 'deepseek_v41')"
    )


def _common(t, problems: list[str]) -> dict[str, Any]:
    """The shared text-model fields as ModelConfig keywords, with the relations between them."""
    kw: dict[str, Any] = {
        k: getattr(t, k)
        for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
            "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
            "index_topk", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
            "routed_scaling_factor", "scoring_func", "swiglu_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
            "max_position_embeddings", "num_nextn_predict_layers", "norm_topk_prob", "topk_method",
        )
    }  # fmt: skip
    kw["compress_ratios"] = tuple(t.compress_ratios)
    kw["compress_rope_theta"] = float(t.compress_rope_theta)
    kw["rope_theta"] = float(t.rope_theta)
    kw["rms_norm_eps"] = float(t.rms_norm_eps)
    if t.head_dim <= t.qk_rope_head_dim or t.qk_rope_head_dim % 2:
        problems.append("'qk_rope_head_dim' must be even and smaller than 'head_dim'")
    if t.index_head_dim < t.qk_rope_head_dim:
        problems.append("'index_head_dim' must be at least 'qk_rope_head_dim' (its last dims are roped)")
    if t.num_attention_heads % t.o_groups:
        problems.append("'num_attention_heads' must be a multiple of 'o_groups'")
    if t.num_experts_per_tok > t.n_routed_experts:
        problems.append("'num_experts_per_tok' must be between 1 and 'n_routed_experts'")
    for name in ("hidden_size", "moe_intermediate_size"):
        if getattr(t, name) % 32:
            problems.append(f"'{name}' must be a multiple of 32 (FP4 scale blocks), found {getattr(t, name)}")
    rs = t.rope_scaling
    if rs is not None:
        if "yarn" not in (rs.type, rs.rope_type):
            problems.append('\'rope_scaling\' needs "type" (or "rope_type") "yarn", the only scaling the model uses')
        kw["rope_scaling"] = RopeScaling(
            float(rs.factor), rs.original_max_position_embeddings, float(rs.beta_fast), float(rs.beta_slow)
        )
    if len(t.compress_ratios) < t.num_hidden_layers:
        problems.append(
            f"'compress_ratios' has {len(t.compress_ratios)} entries, fewer than num_hidden_layers"
            f" ({t.num_hidden_layers})"
        )
    return kw


def _token_ids(top, vocab: int, problems: list[str]) -> dict[str, Any]:
    eos = top.eos_token_id[0] if isinstance(top.eos_token_id, list) else top.eos_token_id
    out = {"bos_token_id": top.bos_token_id, "eos_token_id": eos}
    for name in ("pad_token_id", "image_token_id"):
        if getattr(top, name, None) is not None:
            out[name] = getattr(top, name)
    for name, x in out.items():
        if x >= vocab:
            problems.append(f"'{name}' {x} is outside the vocabulary (vocab_size {vocab})")
    return out


def _quant(q, expert_dtype: str) -> dict[str, Any]:
    return {
        "fp8_block": (q.weight_block_size[0], q.weight_block_size[1]),
        "scale_fmt": q.scale_fmt or "float",
        "expert_dtype": expert_dtype,
    }


def _from_v4(c: ConfigV4, problems: list[str]) -> dict[str, Any]:
    kw = _common(c, problems)
    kw.update(_token_ids(c, c.vocab_size, problems))
    kw.update(_quant(c.quantization_config, c.expert_dtype))
    kw.update(family=V4, model_type=c.model_type, num_hash_layers=c.num_hash_layers)
    n, n_mtp = c.num_hidden_layers, c.num_nextn_predict_layers
    if c.num_hash_layers > n:
        problems.append(f"'num_hash_layers' {c.num_hash_layers} is more than num_hidden_layers ({n})")
    keys = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")
    given = [k for k in keys if getattr(c, k) is not None]
    if given:
        missing = [k for k in keys if getattr(c, k) is None]
        if missing:
            problems.append(f"the dspark_* keys come together (the 0731 layout): missing '{missing[0]}'")
        else:
            kw["dspark"] = _dspark(c, n, problems)
            n_mtp = len(c.compress_ratios) - n
    if len(c.compress_ratios) != n + n_mtp and not given:
        problems.append(
            f"'compress_ratios' has {len(c.compress_ratios)} entries, expected num_hidden_layers"
            f" + num_nextn_predict_layers = {n + n_mtp}"
        )
    return kw


def _dspark(c, n: int, problems: list[str], **extra) -> DSparkConfig | None:
    stages = len(c.compress_ratios) - n
    targets = c.dspark_target_layer_ids
    if not targets or any(t >= n for t in targets) or len(set(targets)) != len(targets):
        problems.append(f"'dspark_target_layer_ids' should list distinct main layers 0..{n - 1}, found {targets!r}")
    if stages < 1:
        problems.append(
            f"'compress_ratios' has {len(c.compress_ratios)} entries for {n} layers: the dspark_* keys"
            " need one more entry per drafter stage"
        )
    if c.dspark_noise_token_id >= c.vocab_size:
        problems.append(f"'dspark_noise_token_id' {c.dspark_noise_token_id} is outside the vocabulary")
    if problems:
        return None
    return DSparkConfig(
        block_size=c.dspark_block_size,
        noise_token_id=c.dspark_noise_token_id,
        target_layer_ids=tuple(targets),
        markov_rank=c.dspark_markov_rank,
        stages=stages,
        **extra,
    )


def _from_v41(c: ConfigV41, problems: list[str]) -> dict[str, Any]:
    t = c.text_config
    kw = _common(t, problems)
    kw.update(_token_ids(c, t.vocab_size, problems))
    kw.update(_quant(c.quantization_config, c.quantization_config.expert_dtype))
    kw.update(family=V41, model_type=c.model_type, num_hash_layers=0)
    n = t.num_hidden_layers
    ratios = t.compress_ratios
    main = ratios[:n]
    if any(r > 2 for r in main):
        problems.append(f"V4.1 compress ratios are 0, 1 or 2 (ratio 1 = a per-token latent), found {sorted(set(main))}")
    n_mtp = t.num_nextn_predict_layers
    if len(ratios) != n + n_mtp:
        problems.append(
            f"'compress_ratios' has {len(ratios)} entries, expected num_hidden_layers + num_nextn_predict_layers"
            f" = {n + n_mtp}"
        )
    elif any(ratios[n:]):
        problems.append("the DSpark stages' compress_ratios (past the main layers) must be 0: they are window-only")
    kw["shared"] = _shared(t, main, problems)
    kw["engram"] = _engram(t, problems)
    keys = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")
    if n_mtp:
        missing = [k for k in (*keys, "dspark_n_routed_experts", "dspark_num_experts_per_tok") if getattr(t, k) is None]
        if missing:
            problems.append(f"{n_mtp} DSpark stages need the dspark_* keys: missing 'text_config.{missing[0]}'")
        elif not problems:
            e, k = t.dspark_n_routed_experts, t.dspark_num_experts_per_tok
            if k > e:
                problems.append("'dspark_num_experts_per_tok' must be at most 'dspark_n_routed_experts'")
            kw["dspark"] = _dspark(t, n, problems, n_routed_experts=e, num_experts_per_tok=k)
    elif any(getattr(t, k) is not None for k in keys):
        problems.append("dspark_* keys without DSpark stages: set 'num_nextn_predict_layers' or remove them")
    if c.vision_config is not None:
        v = c.vision_config
        if v.hidden_size % v.num_attention_heads or (v.hidden_size // v.num_attention_heads) % 4:
            problems.append(
                "'vision_config.hidden_size' must split into heads whose width is a multiple of 4 (2-D RoPE)"
            )
        kw["vision"] = VisionConfig(**{k: getattr(v, k) for k in VisionConfig.__dataclass_fields__})
        if c.image_token_id is None:
            problems.append("a vision tower needs 'image_token_id'")
    return kw


def _layer_list(name: str, ids: list[int], n: int, problems: list[str]) -> tuple[int, ...]:
    if any(i >= n for i in ids) or len(set(ids)) != len(ids) or list(ids) != sorted(ids):
        problems.append(f"'{name}' must list distinct main layers 0..{n - 1} in order, found {ids!r}")
    return tuple(ids)


def _shared(t, ratios: list[int], problems: list[str]) -> SharedAttention | None:
    n = t.num_hidden_layers
    before = len(problems)
    kv = _layer_list("kv_source_layer_ids", t.kv_source_layer_ids, n, problems)
    ix = _layer_list("index_source_layer_ids", t.index_source_layer_ids, n, problems)
    if len(problems) > before or len(ratios) < n:
        return None
    for s in kv:
        if ratios[s] == 0:
            problems.append(f"kv source layer {s} has compress ratio 0: it has nothing to compress")
        if s not in ix:
            problems.append(f"kv source layer {s} is not in 'index_source_layer_ids' (its index keys need its indexer)")
    for layer, r in enumerate(ratios):
        if r == 0:
            if layer in ix:
                problems.append(f"index source layer {layer} has compress ratio 0: it has no compressed rows to index")
            continue
        src = [s for s in kv if s <= layer]
        if not src or ratios[src[-1]] != r:
            problems.append(
                f"layer {layer} (ratio {r}) has no kv source of ratio {r} at or before it to read"
                " ('kv_source_layer_ids')"
            )
            break
        # with kv sources among the index sources, the latest index source then has this ratio too
        if not [s for s in ix if s <= layer]:
            problems.append(f"layer {layer} has no index source at or before it ('index_source_layer_ids')")
            break
    cand = t.candidate_source_layer_id
    if cand >= 0:
        if cand not in ix:
            problems.append(f"'candidate_source_layer_id' {cand} is not an index source")
        if t.candidate_topk_blocks < 1 or t.candidate_block_size < 1:
            problems.append("a candidate source needs 'candidate_topk_blocks' and 'candidate_block_size' of at least 1")
        elif (t.candidate_topk_blocks - 1) * t.candidate_block_size + 1 < t.index_topk:
            # the newest block may hold one row: a smaller pool makes the later layers' top-k pick
            # masked rows among ties, which no implementation can reproduce
            problems.append(
                f"the candidate pool ((candidate_topk_blocks - 1) x candidate_block_size + 1 ="
                f" {(t.candidate_topk_blocks - 1) * t.candidate_block_size + 1} rows) is smaller than index_topk"
                f" {t.index_topk}"
            )
    if len(problems) > before:
        return None
    return SharedAttention(kv, ix, cand, t.candidate_topk_blocks, t.candidate_block_size)


# Rows a token reads over all Engram layers, bounded so the bucket primes are found in milliseconds.
MAX_ENGRAM_COLUMNS = 4096


def _engram(t, problems: list[str]) -> EngramConfig | None:
    if not t.engram_layer_ids:
        if t.engram_num_embeddings:
            problems.append("'engram_num_embeddings' without 'engram_layer_ids'")
        return None
    before = len(problems)
    ids = _layer_list("engram_layer_ids", t.engram_layer_ids, t.num_hidden_layers, problems)
    rows = tuple(t.engram_num_embeddings)
    if len(rows) != len(ids):
        problems.append(
            f"'engram_num_embeddings' has {len(rows)} entries for {len(ids)} Engram layers ('engram_layer_ids')"
        )
    if t.engram_head_dim % 32:
        problems.append(f"'engram_head_dim' must be a multiple of 32 (E8M0 scale blocks), found {t.engram_head_dim}")
    if t.engram_compressed_vocab_size > t.vocab_size:
        problems.append("'engram_compressed_vocab_size' is larger than 'vocab_size'")
    if t.engram_pad_token_id >= t.vocab_size:
        problems.append(f"'engram_pad_token_id' {t.engram_pad_token_id} is outside the vocabulary")
    cols = len(ids) * (t.engram_max_ngram_size - 1) * t.engram_n_heads
    if cols > MAX_ENGRAM_COLUMNS:
        problems.append(
            f"{cols} Engram hash columns (layers x (max_ngram_size - 1) x n_heads); at most {MAX_ENGRAM_COLUMNS}"
        )
    if len(problems) > before:
        return None
    e = EngramConfig(
        layer_ids=ids,
        rows=rows,
        max_ngram_size=t.engram_max_ngram_size,
        vocab_size=t.engram_vocab_size,
        n_heads=t.engram_n_heads,
        head_dim=t.engram_head_dim,
        pad_token_id=t.engram_pad_token_id,
        compressed_vocab_size=t.engram_compressed_vocab_size,
    )
    want = tuple(sum(p) for p in e.primes())
    if want != rows:
        problems.append(
            f"'engram_num_embeddings' is {list(rows)} but the bucket primes above engram_vocab_size"
            f" {t.engram_vocab_size} give tables of {list(want)} rows"
        )
        return None
    return e
