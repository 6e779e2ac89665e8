"""ModelConfig on the real V4-Flash config, a V4-Pro-shaped one, and broken ones."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from dsv4stream.checkpoint.config import CSA, HCA, WINDOW, ModelConfig
from dsv4stream.checkpoint.spec import trunk_nbytes
from dsv4stream.errors import ConfigError

PACKAGED = Path(__file__).resolve().parents[1] / "dsv4stream" / "v4_flash_config.json"
SHARED = Path("/work/shared/v4_flash_config.json")
GIB = 1 << 30


def flash_dict() -> dict:
    return json.loads(PACKAGED.read_text())


def pro_dict() -> dict:
    d = flash_dict()
    d.update(
        num_hidden_layers=61, hidden_size=7168, n_routed_experts=384, moe_intermediate_size=3072,
        q_lora_rank=1536, o_groups=16, num_attention_heads=128, index_topk=1024,
        compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0],
    )  # fmt: skip
    return d


# sha256 of the released V4-Flash config.json's content (keys sorted, no spaces), taken from
# the copy the project was given as the release's (/work/shared/v4_flash_config.json)
RELEASED_SHA256 = "610c24153bee191ae1607521de219840599880627be5dbc11210e7c7dd976d5b"


def content_sha256(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_packaged_copy_is_the_released_config():
    """Every key and value of the packaged copy is the release's: checked against the
    release's content hash everywhere (CI included), and against the shared copy itself
    where it is present (which also keeps the hash honest)."""
    assert content_sha256(flash_dict()) == RELEASED_SHA256
    if SHARED.exists():
        shared = json.loads(SHARED.read_text())
        assert shared == flash_dict() and content_sha256(shared) == RELEASED_SHA256


def test_flash_numbers():
    cfg = ModelConfig.from_json(PACKAGED)
    assert (cfg.n_layers, cfg.n_mtp, len(cfg.compress_ratios)) == (43, 1, 44)
    assert cfg.working_set_experts == 43 * 6 == 258
    # three FP4 matrices 2048x4096: packed nibbles + one E8M0 byte per 32 inputs
    assert cfg.expert_bytes == 3 * (2048 * 4096 // 2 + 2048 * 4096 // 32) == 13_369_344
    assert cfg.working_set_bytes == 258 * 13_369_344
    assert round(cfg.working_set_bytes / GIB, 2) == 3.21
    assert cfg.total_expert_bytes == 44 * 256 * 13_369_344
    kinds = cfg.layer_kinds
    assert len(kinds) == 43
    assert kinds[:4] == (WINDOW, WINDOW, CSA, HCA)
    assert (kinds.count(WINDOW), kinds.count(CSA), kinds.count(HCA)) == (2, 21, 20)
    assert cfg.layer_kind(43) == WINDOW  # the MTP block's own entry
    assert [cfg.is_hash_layer(i) for i in range(5)] == [True, True, True, False, False]
    assert cfg.fp8_block == (128, 128) and cfg.scale_fmt == "ue8m0" and cfg.expert_dtype == "fp4"
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 16
    assert isinstance(cfg.rope_theta, float) and cfg.compress_rope_theta == 160000.0
    t = trunk_nbytes(cfg)
    assert t["embed"] == t["head"] == 129280 * 4096 * 2
    assert 6.0 < t["trunk"] / GIB < 6.6  # "about 6.3 GB"


def test_pro_shape_accepted():
    cfg = ModelConfig.from_dict(pro_dict())
    assert len(cfg.compress_ratios) == 62 and cfg.n_layers == 61
    assert cfg.layer_kinds[:4] == (HCA, HCA, CSA, HCA)
    assert cfg.layer_kind(60) == CSA and cfg.layer_kind(61) == WINDOW
    assert cfg.working_set_experts == 61 * 6
    assert cfg.expert_bytes == 3 * (3072 * 7168 // 2 + 3072 * 7168 // 32)
    assert cfg.num_attention_heads // cfg.o_groups == 8


def test_many_missing_fields_in_one_message():
    d = flash_dict()
    for k in ("hidden_size", "vocab_size", "scoring_func", "hc_mult"):
        del d[k]
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict(d, source="cfg.json")
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("cfg.json: ")
    for k in ("hidden_size", "vocab_size", "scoring_func", "hc_mult"):
        assert f"missing '{k}'" in msg


def test_invalid_fields_all_reported():
    d = flash_dict()
    d.update(hidden_size="4096", num_hidden_layers=-1, swiglu_limit=True, expert_dtype="int4")
    d["quantization_config"] = dict(d["quantization_config"], weight_block_size=[128])
    msg = str(pytest.raises(ConfigError, ModelConfig.from_dict, d).value)
    assert "'hidden_size': input should be a valid integer, found '4096'" in msg
    assert "'num_hidden_layers' must be at least 1, found -1" in msg
    assert "'swiglu_limit': input should be a valid number, found True" in msg
    assert "'expert_dtype' must be 'fp4' or 'fp8', found 'int4'" in msg and "weight_block_size" in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    "change, words",
    [
        ({"compress_ratios": [0] * 43}, "'compress_ratios' has 43 entries, expected num_hidden_layers + num_nextn_predict_layers = 44"),
        ({"num_nextn_predict_layers": 0}, "expected num_hidden_layers + num_nextn_predict_layers = 43"),
        ({"compress_ratios": [0, -4] + [0] * 42}, "'compress_ratios.1' must be at least 0, found -4"),
        ({"scoring_func": "softmax"}, "'scoring_func' must be 'sqrtsoftplus'"),
        ({"num_experts_per_tok": 300}, "'num_experts_per_tok' must be at most 64"),
        ({"num_experts_per_tok": 60, "n_routed_experts": 32}, "'num_experts_per_tok' must be between 1 and 'n_routed_experts'"),
        ({"o_groups": 7}, "multiple of 'o_groups'"),
        ({"moe_intermediate_size": 2050}, "'moe_intermediate_size' must be a multiple of 32"),
        ({"qk_rope_head_dim": 63}, "'qk_rope_head_dim' must be even"),
        ({"num_hash_layers": 44}, "'num_hash_layers' 44 is more than num_hidden_layers"),
    ],
)  # fmt: skip
def test_inconsistent_fields(change, words):
    d = flash_dict()
    d.update(change)
    assert words in str(pytest.raises(ConfigError, ModelConfig.from_dict, d).value)


def test_small_ratios_are_heavily_compressed():
    d = flash_dict()
    d.update(num_hidden_layers=5, compress_ratios=[0, 4, 8, 16, 128, 0])
    cfg = ModelConfig.from_dict(d)
    assert cfg.layer_kinds == (WINDOW, CSA, HCA, HCA, HCA)


def test_release_optional_fields():
    d = flash_dict()
    d["eos_token_id"] = [1]
    d["quantization_config"] = dict(d["quantization_config"], scale_fmt=None)
    cfg = ModelConfig.from_dict(d)
    assert cfg.eos_token_id == 1 and cfg.eos_token_ids == (1,) and cfg.scale_fmt == "float"
    d = flash_dict()
    d["rope_theta"] = 10000  # ints are accepted for float fields
    assert ModelConfig.from_dict(d).rope_theta == 10000.0
    d["eos_token_id"] = [1, 2]  # generation stops on one EOS id: a second one would be ignored
    assert "'eos_token_id'" in str(pytest.raises(ConfigError, ModelConfig.from_dict, d).value)


def test_from_json_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json is missing"):
        ModelConfig.from_json(tmp_path / "config.json")
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON"):
        ModelConfig.from_json(p)
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_json(p)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"quantization_config": "fp8"}, "'quantization_config': input should be a valid dictionary"),
        ({"quantization_config": None}, "'quantization_config'"),
        ({"quantization_config": []}, "'quantization_config'"),
        ({"eos_token_id": []}, "'eos_token_id'"),
        ({"eos_token_id": "x"}, "'eos_token_id'"),
        ({"eos_token_id": [True]}, "'eos_token_id'"),
        ({"eos_token_id": [1, "x"]}, "'eos_token_id'"),
        ({"bos_token_id": -5}, "'bos_token_id' must be at least 0"),
        ({"bos_token_id": 10**9}, "'bos_token_id' must be at most"),
        ({"bos_token_id": 200000}, "'bos_token_id' 200000 is outside the vocabulary"),
        ({"o_groups": 0}, "'o_groups' must be at least 1"),
        ({"sliding_window": 0}, "'sliding_window' must be at least 1"),
        ({"index_topk": 0}, "'index_topk' must be at least 1"),
        ({"compress_rope_theta": -1}, "'compress_rope_theta' must be above 0"),
        ({"rope_theta": 0}, "'rope_theta' must be above 0"),
        ({"rms_norm_eps": float("nan")}, "'rms_norm_eps' must be a finite number"),
        ({"rms_norm_eps": 0}, "'rms_norm_eps' must be above 0"),
        ({"rms_norm_eps": 1e300}, "'rms_norm_eps' must be at most 0.01"),
        ({"routed_scaling_factor": float("inf")}, "'routed_scaling_factor' must be a finite number"),
        ({"hc_eps": float("-inf")}, "'hc_eps' must be a finite number"),
        ({"hc_sinkhorn_iters": 10**9}, "'hc_sinkhorn_iters' must be at most 1000"),
        ({"n_routed_experts": 10**9}, "'n_routed_experts' must be at most 4096"),
        ({"swiglu_limit": -1}, "'swiglu_limit' must be above 0"),
        ({"scale_fmt": "weird"}, "'quantization_config.scale_fmt' must be 'ue8m0' or 'float'"),
        ({"max_position_embeddings": "big"}, "'max_position_embeddings': input should be a valid integer"),
        ({"max_position_embeddings": 0}, "'max_position_embeddings' must be at least 1"),
        ({"num_nextn_predict_layers": True}, "'num_nextn_predict_layers': input should be a valid integer"),
        ({"weight_block_size": [True, 128]}, "'quantization_config.weight_block_size.0'"),
        ({"rope_scaling": {"factor": float("nan"), "original_max_position_embeddings": 65536, "type": "yarn"}}, "'rope_scaling.factor' must be a finite number"),
        ({"rope_scaling": {"factor": 16, "original_max_position_embeddings": 65536}}, "'rope_scaling' needs"),
        ({"norm_topk_prob": "yes"}, "'norm_topk_prob' must be True"),
        ({"norm_topk_prob": False}, "'norm_topk_prob' must be True"),
        ({"topk_method": "greedy"}, "'topk_method' must be 'noaux_tc'"),
        ({"hidden_act": "gelu"}, "'hidden_act' must be 'silu'"),
        ({"tie_word_embeddings": True}, "'tie_word_embeddings' must be False"),
        ({"num_key_value_heads": 8}, "'num_key_value_heads' must be 1"),
        ({"surprise_key": 1}, "unknown key 'surprise_key'"),
        ({"model_type": "deepseek_v3"}, "DeepSeek-V3 (model_type 'deepseek_v3') is not supported"),
    ],
)  # fmt: skip
def test_bad_values_are_one_config_error(change, words):
    d = flash_dict()
    for k, v in change.items():
        if k in ("scale_fmt", "weight_block_size"):
            d["quantization_config"] = dict(d["quantization_config"], **{k: v})
        else:
            d[k] = v
    msg = str(pytest.raises(ConfigError, ModelConfig.from_dict, d).value)
    assert words in msg and "\n" not in msg


def test_nan_and_infinity_in_the_json_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(flash_dict()).replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN'))
    assert '"rms_norm_eps": NaN' in p.read_text()
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        ModelConfig.from_json(p)
    p.unlink()
    os.mkfifo(p)
    with pytest.raises(ConfigError, match="config.json is a FIFO, not a regular file"):
        ModelConfig.from_json(p)


def test_missing_model_type_is_refused():
    d = flash_dict()
    del d["model_type"]
    assert "no 'model_type'" in str(pytest.raises(ConfigError, ModelConfig.from_dict, d).value)


def test_deeply_nested_and_oversized_config_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "deepseek_v4", "x": ' + "[" * 5000 + "]" * 5000 + "}")
    msg = str(pytest.raises(ConfigError, ModelConfig.from_json, p).value)
    assert "config.json is not valid JSON" in msg and "\n" not in msg
    p.write_text('{"model_type": "deepseek_v4", "x": ' + "[" * 100 + "]" * 100 + "}")
    assert "nests deeper than 64 levels" in str(pytest.raises(ConfigError, ModelConfig.from_json, p).value)
    p.write_text(json.dumps(flash_dict()) + " " * (2 << 20))
    assert "bytes, more than the" in str(pytest.raises(ConfigError, ModelConfig.from_json, p).value)
