"""The model's shape, read once from the checkpoint's `config.json`.

Owns: parsing and validating the released config schema (field names exactly as DeepSeek
publishes them), the layer kinds derived from `compress_ratios`, and the byte arithmetic
that planning needs (expert bytes, working set per pass). It reads no weights.

`compress_ratios` holds one entry per main layer plus one per block under `mtp.*`: 0 =
window-only attention, 4 = compressed sparse attention (with the lightning indexer), any other
positive ratio = heavily compressed attention (the release uses 128; tiny test models use 8 or 16).

Two layouts of the `mtp.*` blocks are released (see `LAYOUTS`): the May preview's one MTP block
(`num_nextn_predict_layers` blocks) and DeepSeek-V4-Flash-0731's DSpark drafter, announced by the
`dspark_*` keys, whose stages are the compress_ratios entries past the main layers (three in
0731, while `num_nextn_predict_layers` stays 1). Neither is run: the main model is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

WINDOW, CSA, HCA = "window", "csa", "hca"
PREVIEW, DSPARK = "mtp", "dspark"
# What each layout of the `mtp.*` blocks is called where a person reads it.
LAYOUTS = {
    PREVIEW: "the preview layout (one MTP block under mtp.0)",
    DSPARK: "the 0731 layout (a DSpark drafter under mtp.*)",
    None: "no mtp.* blocks",
}
SUPPORTED_MODEL_TYPE = "deepseek_v4"
# Architectures people point dsv4 at that share names with V4 but not its tensors. Only the
# model_type string is relied on here (V4.1-Flash publishes `deepseek_v41`).
UNSUPPORTED_MODEL_TYPES = {
    "deepseek_v41": "DeepSeek-V4.1",
    "deepseek_v3": "DeepSeek-V3",
    "deepseek_v32": "DeepSeek-V3.2",
}

# (field, python type) for everything the forward pass and the planner read.
_REQUIRED: tuple[tuple[str, type], ...] = (
    ("vocab_size", int),
    ("hidden_size", int),
    ("num_hidden_layers", int),
    ("num_attention_heads", int),
    ("head_dim", int),
    ("qk_rope_head_dim", int),
    ("q_lora_rank", int),
    ("o_groups", int),
    ("o_lora_rank", int),
    ("sliding_window", int),
    ("compress_ratios", list),
    ("compress_rope_theta", float),
    ("rope_theta", float),
    ("rms_norm_eps", float),
    ("index_n_heads", int),
    ("index_head_dim", int),
    ("index_topk", int),
    ("n_routed_experts", int),
    ("n_shared_experts", int),
    ("num_experts_per_tok", int),
    ("moe_intermediate_size", int),
    ("num_hash_layers", int),
    ("routed_scaling_factor", float),
    ("scoring_func", str),
    ("swiglu_limit", float),
    ("hc_mult", int),
    ("hc_sinkhorn_iters", int),
    ("hc_eps", float),
)


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters; applied only on compressed layers (with compress_rope_theta)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class DSparkConfig:
    """The 0731 drafter's keys (`dspark_*`), kept so a drafter can be added later; not run today.

    stages: blocks under mtp.0..stages-1 (compress_ratios entries past the main layers);
    target_layer_ids: main layers whose outputs the first stage reads (concatenated, so its
    `main_proj` is [hidden, hidden * len(target_layer_ids)]); markov_rank: width of the Markov head.
    """

    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    stages: int


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
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        p = Path(path)
        if p.exists() and not p.is_file():
            raise ConfigError(f"{p}: not a regular file (a FIFO, device or folder); put the real config.json there")
        if not p.is_file():
            raise ConfigError(f"{p}: config.json not found; point at the checkpoint directory that holds it")
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{p}: not valid JSON ({e}); re-download config.json") from None
        return cls.from_dict(d, source=str(p))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> ModelConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object at the top level")
        _check_model_type(d, source)
        problems: list[str] = []
        vals: dict[str, Any] = {}
        for name, typ in _REQUIRED:
            if name not in d:
                problems.append(f"missing '{name}'")
                continue
            v = d[name]
            ok = isinstance(v, typ) and not isinstance(v, bool)
            if typ is float and isinstance(v, int) and not isinstance(v, bool):
                v, ok = float(v), True
            if not ok:
                problems.append(f"'{name}' should be {typ.__name__}, found {type(v).__name__}")
                continue
            vals[name] = v
        if "compress_ratios" in vals:
            cr = vals["compress_ratios"]
            if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in cr):
                problems.append("'compress_ratios' must be non-negative integers")
            vals["compress_ratios"] = tuple(int(r) for r in cr if isinstance(r, (int, float)))
        n_mtp = d.get("num_nextn_predict_layers", 0)
        if not _is_int(n_mtp) or n_mtp < 0:
            problems.append(f"'num_nextn_predict_layers' should be a non-negative int, found {n_mtp!r}")
            n_mtp = 0
        opt: dict[str, Any] = {"num_nextn_predict_layers": n_mtp}
        for name, default in (
            ("norm_topk_prob", True),
            ("topk_method", "noaux_tc"),
            ("expert_dtype", "fp4"),
            ("bos_token_id", 0),
            ("eos_token_id", 1),
            ("max_position_embeddings", 1 << 20),
        ):
            opt[name] = d.get(name, default)
        if d.get("eos_token_id") is None and "eos_token_id" in d:
            opt["eos_token_id"] = 1
        if isinstance(opt["eos_token_id"], list) and opt["eos_token_id"]:
            opt["eos_token_id"] = opt["eos_token_id"][0]
        if opt["expert_dtype"] not in ("fp4", "fp8"):
            problems.append(f"'expert_dtype' must be 'fp4' or 'fp8', found {opt['expert_dtype']!r}")
        q = d.get("quantization_config") or {}
        if not isinstance(q, dict):
            problems.append(f"'quantization_config' should be an object, found {q!r}")
            q = {}
        block = q.get("weight_block_size", [128, 128])
        if not (isinstance(block, list) and len(block) == 2 and all(_is_int(b) and b > 0 for b in block)):
            problems.append(f"'quantization_config.weight_block_size' must be two positive ints, found {block!r}")
            block = [128, 128]
        opt["fp8_block"] = (int(block[0]), int(block[1]))
        opt["scale_fmt"] = q.get("scale_fmt", "ue8m0") or "float"
        if opt["scale_fmt"] not in SCALE_FMTS:
            problems.append(f"'quantization_config.scale_fmt' must be 'ue8m0' or null, found {opt['scale_fmt']!r}")
        problems += _check_values(vals, opt)
        rs = d.get("rope_scaling")
        if rs:
            try:
                opt["rope_scaling"] = RopeScaling(
                    factor=float(rs["factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                    beta_fast=float(rs.get("beta_fast", 32)),
                    beta_slow=float(rs.get("beta_slow", 1)),
                )
                r = opt["rope_scaling"]
                if not (_finite(r.factor) and r.factor > 0 and r.original_max_position_embeddings > 0):
                    raise ValueError
                if not (_finite(r.beta_fast) and _finite(r.beta_slow)):
                    raise ValueError
            except (KeyError, TypeError, ValueError, AttributeError):
                problems.append(
                    "'rope_scaling' needs a finite positive 'factor', a positive 'original_max_position_embeddings'"
                    " and finite betas"
                )
        opt["model_type"] = d.get("model_type", SUPPORTED_MODEL_TYPE)
        if any(k.startswith("dspark_") for k in d) and "num_hidden_layers" in vals and "compress_ratios" in vals:
            opt["dspark"] = _dspark(d, vals, problems)
            n_mtp = opt["dspark"].stages if opt["dspark"] else n_mtp
        if not problems:
            problems += _check_consistency(vals, n_mtp)
        if problems:
            raise ConfigError(
                f"{source}: " + "; ".join(problems) + " — fix config.json (it must be the released schema)"
            )
        return cls(**vals, **opt, raw=dict(d))

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
        """Which layout the mtp.* blocks follow: PREVIEW, DSPARK, or None (no blocks)."""
        if self.dspark:
            return DSPARK
        return PREVIEW if self.num_nextn_predict_layers else None

    def ratio(self, layer: int) -> int:
        """Compress ratio of main layer `layer`, or of MTP layer k at index n_layers + k."""
        return self.compress_ratios[layer]

    def layer_kind(self, layer: int) -> str:
        r = self.compress_ratios[layer]
        return WINDOW if r == 0 else CSA if r == 4 else HCA

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(self.layer_kind(i) for i in range(self.n_layers))

    def is_hash_layer(self, layer: int) -> bool:
        """Hash-routed MoE: the first num_hash_layers main layers (never the MTP block)."""
        return layer < min(self.num_hash_layers, self.n_layers)

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
        return (self.n_layers + self.n_mtp) * self.n_routed_experts * self.expert_bytes


SCALE_FMTS = ("ue8m0", "float")  # "float": null in config.json, F32 scales
# fields that must be above 0 (ints) or finite and above 0 (floats); the rest may be 0, not negative
_POSITIVE = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
    "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
    "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters",
    "compress_rope_theta", "rope_theta", "rms_norm_eps", "routed_scaling_factor",
)  # fmt: skip


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_values(v: dict[str, Any], opt: dict[str, Any]) -> list[str]:
    """Ranges of the values the math divides by, takes logs of, or indexes with."""
    p: list[str] = []
    for name, x in v.items():
        if isinstance(x, float) and not math.isfinite(x):
            p.append(f"'{name}' must be a finite number, found {x}")
        elif isinstance(x, (int, float)) and x < 0:
            p.append(f"'{name}' must not be negative, found {x}")
        elif name in _POSITIVE and isinstance(x, (int, float)) and x == 0:
            p.append(f"'{name}' must be above 0, found {x}")
    vocab = v.get("vocab_size")
    for name in ("bos_token_id", "eos_token_id"):
        x = opt[name]
        if not _is_int(x) or x < 0 or (_is_int(vocab) and x >= vocab):
            p.append(f"'{name}' must be a token id in 0..vocab_size-1 (or a non-empty list of them), found {x!r}")
    mpe = opt["max_position_embeddings"]
    if not _is_int(mpe) or mpe <= 0:
        p.append(f"'max_position_embeddings' must be a positive int, found {mpe!r}")
    if not isinstance(opt["norm_topk_prob"], bool):
        p.append(f"'norm_topk_prob' must be true or false, found {opt['norm_topk_prob']!r}")
    if not isinstance(opt["topk_method"], str):
        p.append(f"'topk_method' must be a string, found {opt['topk_method']!r}")
    return p


def _check_model_type(d: dict[str, Any], source: str) -> None:
    """Refuse another architecture before its fields are read as V4's (one clear line)."""
    mt = d.get("model_type", SUPPORTED_MODEL_TYPE)
    if mt == SUPPORTED_MODEL_TYPE:
        return
    name = UNSUPPORTED_MODEL_TYPES.get(mt)
    what = f"{name} (model_type {mt!r})" if name else f"model_type {mt!r}"
    raise ConfigError(
        f"{source}: {what} is not supported; dsv4stream runs DeepSeek-V4"
        f" (model_type {SUPPORTED_MODEL_TYPE!r}): V4-Flash, V4-Flash-0731 and V4-Pro"
    )


def _dspark(d: dict[str, Any], v: dict[str, Any], problems: list[str]) -> DSparkConfig | None:
    """The drafter keys; its stage count is what compress_ratios holds past the main layers."""
    n = v["num_hidden_layers"]
    stages = len(v["compress_ratios"]) - n
    vals: dict[str, Any] = {}
    for key in ("dspark_block_size", "dspark_noise_token_id", "dspark_markov_rank"):
        x = d.get(key)
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            problems.append(f"'{key}' should be a non-negative int (the 0731 layout), found {x!r}")
        vals[key] = x
    targets = d.get("dspark_target_layer_ids")
    ok = isinstance(targets, list) and targets and all(isinstance(t, int) and 0 <= t < n for t in targets)
    if not ok:
        problems.append(f"'dspark_target_layer_ids' should list main layers 0..{n - 1}, found {targets!r}")
    if stages < 1:
        problems.append(
            f"'compress_ratios' has {len(v['compress_ratios'])} entries for {n} layers: the dspark_* keys"
            " need one more entry per drafter stage"
        )
    if isinstance(vals["dspark_noise_token_id"], int) and vals["dspark_noise_token_id"] >= v.get("vocab_size", 1 << 62):
        problems.append(f"'dspark_noise_token_id' {vals['dspark_noise_token_id']} is outside the vocabulary")
    if problems:
        return None
    return DSparkConfig(
        block_size=vals["dspark_block_size"],
        noise_token_id=vals["dspark_noise_token_id"],
        target_layer_ids=tuple(targets),
        markov_rank=vals["dspark_markov_rank"],
        stages=stages,
    )


def _check_consistency(v: dict[str, Any], n_mtp: int) -> list[str]:
    p: list[str] = []
    n = v["num_hidden_layers"]
    if len(v["compress_ratios"]) != n + n_mtp:
        p.append(
            f"'compress_ratios' has {len(v['compress_ratios'])} entries, expected num_hidden_layers"
            f" + num_nextn_predict_layers = {n + n_mtp}"
        )
    if v["head_dim"] <= v["qk_rope_head_dim"] or v["qk_rope_head_dim"] % 2:
        p.append("'qk_rope_head_dim' must be even and smaller than 'head_dim'")
    if v["num_attention_heads"] % max(v["o_groups"], 1):
        p.append("'num_attention_heads' must be a multiple of 'o_groups'")
    if v["num_experts_per_tok"] > v["n_routed_experts"] or v["num_experts_per_tok"] < 1:
        p.append("'num_experts_per_tok' must be between 1 and 'n_routed_experts'")
    if v["scoring_func"] != "sqrtsoftplus":
        p.append(f"'scoring_func' must be 'sqrtsoftplus' (DeepSeek-V4), found {v['scoring_func']!r}")
    for name in ("hidden_size", "moe_intermediate_size"):
        if v[name] % 32:
            p.append(f"'{name}' must be a multiple of 32 (FP4 scale blocks), found {v[name]}")
    for name in ("hidden_size", "num_attention_heads", "head_dim", "hc_mult", "vocab_size", "num_hidden_layers"):
        if v[name] <= 0:
            p.append(f"'{name}' must be positive")
    return p
