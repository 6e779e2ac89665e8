"""The declared schema of every `config.json` dsv4stream reads: DeepSeek-V4 (flat) and
DeepSeek-V4.1 (nested), as pydantic models.

Owns: the key set (an unknown key is refused: a key nobody reads would be ignored, and a
field that is neither honoured nor refused can silently change the model), a type for every
value (strict: no "4096" for 4096, no true for 1), a range for every number, a set for every
string. Each range is what the code can run, not what the release happens to use: a count
past its range is a config that would hang or allocate without bound before any tensor is
read (hc_sinkhorn_iters 1e9, n_routed_experts 1e9). Relations between fields (compress_ratios
length, source layers, Engram table rows) are checked by `config` after this.

Fields that only training reads (`initializer_range`, `attention_dropout`) and HF runtime
flags (`use_cache`: dsv4stream always keeps its caches) are validated and have no effect;
fields whose other values would change the model (`hidden_act`, `attention_bias`,
`tie_word_embeddings`, `num_key_value_heads`, `topk_method`, `norm_topk_prob`, ...) are
pinned to the one value the forward pass implements.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# A count the code allocates or loops by: bounded so that a wrong value is refused up front.
Count = Annotated[int, Field(ge=1, le=1 << 20)]
TokenId = Annotated[int, Field(ge=0, le=(1 << 20) - 1)]
Theta = Annotated[float, Field(gt=0, le=1e12)]
LayerIds = Annotated[list[Annotated[int, Field(ge=0, le=4095)]], Field(max_length=4096)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


class RopeScalingV4(_Strict):
    type: Literal["yarn"] | None = None
    rope_type: Literal["yarn"] | None = None
    factor: float = Field(gt=0, le=1e6)
    original_max_position_embeddings: int = Field(ge=1, le=1 << 26)
    beta_fast: float = Field(32.0, gt=0, le=1e6)
    beta_slow: float = Field(1.0, gt=0, le=1e6)


class QuantV4(_Strict):
    quant_method: Literal["fp8"]
    activation_scheme: Literal["dynamic"] = "dynamic"
    fmt: Literal["e4m3"] = "e4m3"
    # "ue8m0" (the release): E8M0 scale bytes; null or "float" (generated checkpoints): F32 scales
    scale_fmt: Literal["ue8m0", "float"] | None = "ue8m0"
    weight_block_size: Annotated[list[Annotated[int, Field(ge=1, le=4096)]], Field(min_length=2, max_length=2)]


class QuantV41(QuantV4):
    fmt: None = None  # V4.1 drops it
    expert_dtype: Literal["fp4", "fp8"]


class _Model(_Strict):
    """The fields V4 and V4.1's text model share, with their ranges."""

    vocab_size: int = Field(ge=2, le=1 << 20)
    hidden_size: int = Field(ge=32, le=65536)
    num_hidden_layers: int = Field(ge=1, le=512)
    num_attention_heads: int = Field(ge=1, le=1024)
    num_key_value_heads: Literal[1] = 1
    head_dim: int = Field(ge=4, le=8192)
    qk_rope_head_dim: int = Field(ge=2, le=8192)
    q_lora_rank: int = Field(ge=1, le=65536)
    o_groups: int = Field(ge=1, le=1024)
    o_lora_rank: int = Field(ge=1, le=65536)
    sliding_window: int = Field(ge=1, le=1 << 20)
    compress_ratios: Annotated[list[Annotated[int, Field(ge=0, le=1 << 16)]], Field(min_length=1, max_length=1024)]
    compress_rope_theta: Theta
    rope_theta: Theta
    rms_norm_eps: float = Field(gt=0, le=1e-2)
    index_n_heads: int = Field(ge=1, le=1024)
    index_head_dim: int = Field(ge=4, le=8192)
    index_topk: Count
    n_routed_experts: int = Field(ge=1, le=4096)
    n_shared_experts: int = Field(ge=1, le=16)
    num_experts_per_tok: int = Field(ge=1, le=64)
    moe_intermediate_size: int = Field(ge=32, le=65536)
    routed_scaling_factor: float = Field(gt=0, le=1e3)
    scoring_func: Literal["sqrtsoftplus"]
    topk_method: Literal["noaux_tc"] = "noaux_tc"
    norm_topk_prob: Literal[True] = True  # the router always normalises the chosen weights
    swiglu_limit: float = Field(gt=0, le=1e4)
    hidden_act: Literal["silu"] = "silu"
    attention_bias: Literal[False] = False
    attention_dropout: float = Field(0.0, ge=0, le=1)  # training only
    initializer_range: float = Field(0.02, ge=0, le=1)  # training only
    use_cache: bool = True  # an HF runtime flag; dsv4stream always keeps its caches
    tie_word_embeddings: Literal[False] = False  # head.weight is its own tensor
    hc_mult: int = Field(ge=1, le=16)
    hc_sinkhorn_iters: int = Field(ge=1, le=1000)
    hc_eps: float = Field(gt=0, le=1)
    max_position_embeddings: int = Field(1 << 20, ge=1, le=1 << 26)
    num_nextn_predict_layers: int = Field(0, ge=0, le=16)
    dspark_block_size: int | None = Field(None, ge=1, le=64)
    dspark_noise_token_id: TokenId | None = None
    dspark_target_layer_ids: LayerIds | None = None
    dspark_markov_rank: int | None = Field(None, ge=1, le=65536)


class ConfigV4(_Model):
    """DeepSeek-V4 (preview, 0731, Pro): one flat object."""

    model_type: Literal["deepseek_v4"]
    architectures: list[Literal["DeepseekV4ForCausalLM"]] = Field(["DeepseekV4ForCausalLM"], min_length=1, max_length=1)
    torch_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    transformers_version: str | None = Field(None, max_length=64)
    bos_token_id: TokenId = 0
    eos_token_id: TokenId | Annotated[list[TokenId], Field(min_length=1, max_length=1)] = 1
    expert_dtype: Literal["fp4", "fp8"] = "fp4"
    num_hash_layers: int = Field(ge=0, le=512)
    rope_scaling: RopeScalingV4 | None = None
    quantization_config: QuantV4
    dsv4stream_generator: dict[str, Any] | None = None  # provenance our generator writes; never read by the model


class TextV41(_Model):
    """DeepSeek-V4.1's `text_config`."""

    model_type: Literal["deepseek_v41_text"]
    rope_scaling: RopeScalingV4 | None = None
    kv_source_layer_ids: LayerIds
    index_source_layer_ids: LayerIds
    candidate_source_layer_id: int = Field(ge=-1, le=4095)  # -1: no candidate blocks
    candidate_topk_blocks: int = Field(0, ge=0, le=1 << 20)
    candidate_block_size: int = Field(0, ge=0, le=1 << 16)
    engram_layer_ids: LayerIds = []
    engram_num_embeddings: list[Annotated[int, Field(ge=1, le=1 << 34)]] = Field([], max_length=4096)
    engram_max_ngram_size: int = Field(2, ge=2, le=8)
    engram_vocab_size: int = Field(1, ge=1, le=1 << 31)
    engram_n_heads: int = Field(1, ge=1, le=64)
    engram_head_dim: int = Field(32, ge=32, le=4096)
    engram_pad_token_id: TokenId = 2
    engram_compressed_vocab_size: int = Field(1, ge=1, le=1 << 20)
    dspark_n_routed_experts: int | None = Field(None, ge=1, le=4096)
    dspark_num_experts_per_tok: int | None = Field(None, ge=1, le=64)


class VisionV41(_Strict):
    """DeepSeek-V4.1's `vision_config` (the tower is validated, not run)."""

    model_type: Literal["deepseek_v41_vision"]
    num_hidden_layers: int = Field(ge=1, le=256)
    hidden_size: int = Field(ge=2, le=16384)
    num_attention_heads: int = Field(ge=1, le=256)
    intermediate_size: int = Field(ge=1, le=65536)
    patch_size: int = Field(ge=1, le=64)
    rope_theta: Theta = 10000.0
    downsample_ratio: int = Field(ge=1, le=16)
    max_image_tokens: Count
    min_pixels: int = Field(ge=1, le=1 << 30)
    max_wh_ratio: float | None = Field(None, gt=0, le=1e4)


class ConfigV41(_Strict):
    """DeepSeek-V4.1: the text model nested under `text_config`, the tower under `vision_config`."""

    model_type: Literal["deepseek_v41"]
    architectures: list[Literal["DeepseekV41ForCausalLM"]] = Field(
        ["DeepseekV41ForCausalLM"], min_length=1, max_length=1
    )
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    transformers_version: str | None = Field(None, max_length=64)
    bos_token_id: TokenId = 0
    eos_token_id: TokenId | Annotated[list[TokenId], Field(min_length=1, max_length=1)] = 1
    pad_token_id: TokenId | None = None
    image_token_id: TokenId | None = None
    quantization_config: QuantV41
    text_config: TextV41
    vision_config: VisionV41 | None = None
    dsv4stream_generator: dict[str, Any] | None = None


SCHEMAS: dict[str, type[_Strict]] = {"deepseek_v4": ConfigV4, "deepseek_v41": ConfigV41}


def validation_problems(e: ValidationError, limit: int = 12) -> list[str]:
    """pydantic's errors as short phrases: "'text_config.rms_norm_eps' must be <= 0.01, found 1e+300"."""
    out = []
    for err in e.errors(include_url=False):
        loc = ".".join(str(x) for x in err["loc"] if not _is_union_tag(x))
        out.append(_phrase(loc, err))
    # a union reports one error per alternative; keep one line per location
    seen, unique = set(), []
    for p in out:
        key = p.split("'")[1] if p.count("'") >= 2 else p
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique[:limit] + ([f"and {len(unique) - limit} more"] if len(unique) > limit else [])


def _is_union_tag(x: Any) -> bool:
    # pydantic names the union member it tried ("int", "list[int]", "constrained-int", ...)
    return isinstance(x, str) and ("[" in x or x in ("int", "float", "str", "bool", "none")) or x == "constrained-int"


def _phrase(loc: str, err: dict) -> str:
    kind, found, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    shown = _show(found)
    if kind == "missing":
        return f"missing '{loc}'"
    if kind == "extra_forbidden":
        return f"unknown key '{loc}' (dsv4stream cannot honour a field it does not know; remove it)"
    if kind == "literal_error":
        return f"'{loc}' must be {ctx.get('expected', 'one of the known values')}, found {shown}"
    bounds = {
        "greater_than": "above",
        "greater_than_equal": "at least",
        "less_than": "below",
        "less_than_equal": "at most",
    }
    if kind in bounds:
        limit = next(iter(ctx.values()), "?")
        return f"'{loc}' must be {bounds[kind]} {limit}, found {shown}"
    if kind == "finite_number":
        return f"'{loc}' must be a finite number, found {shown}"
    if kind in ("too_short", "too_long"):
        return f"'{loc}' has the wrong number of entries ({err['msg'].lower()}), found {shown}"
    return f"'{loc}': {err['msg'].lower()}, found {shown}"


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
