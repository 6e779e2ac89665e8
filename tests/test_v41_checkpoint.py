"""DeepSeek-V4.1 checkpoints: the released config, the tensor list against the release's ledger,
generated checkpoints that validate, and one-line refusals of malformed ones."""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
from collections import Counter
from pathlib import Path

import pytest

from dsv4stream import synth
from dsv4stream.checkpoint import spec_v41
from dsv4stream.checkpoint.catalog import Catalog, read_header
from dsv4stream.checkpoint.config import DSPARK_V41, SHARED, V41, WINDOW, ModelConfig
from dsv4stream.checkpoint.spec import model_specs, trunk_nbytes
from dsv4stream.checkpoint.tensors import ITEMSIZE
from dsv4stream.errors import CheckpointError, ConfigError
from dsv4stream.synth import v41 as synth_v41

PACKAGED = Path(__file__).resolve().parents[1] / "dsv4stream" / "v41_flash_config.json"


def released() -> dict:
    return json.loads(PACKAGED.read_text())


def release_cfg() -> ModelConfig:
    return ModelConfig.from_json(PACKAGED)


def test_released_config_reads_as_v41():
    cfg = release_cfg()
    assert (cfg.family, cfg.model_type, cfg.layout) == (V41, "deepseek_v41", DSPARK_V41)
    assert (cfg.n_layers, cfg.n_mtp, cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok) == (
        40,
        3,
        5120,
        384,
        6,
    )
    assert cfg.fp8_block == (32, 32) and cfg.scale_fmt == "ue8m0" and cfg.expert_dtype == "fp4"
    assert cfg.rms_norm_eps == 1e-20 and cfg.num_hash_layers == 0
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.image_token_id) == (0, 1, 2, 129264)
    # three FP4 matrices 2304x5120: packed nibbles + one E8M0 byte per 32 inputs
    assert cfg.expert_bytes == 3 * (2304 * 5120 // 2 + 2304 * 5120 // 32) == 18_800_640
    assert cfg.working_set_experts == 240
    assert cfg.layer_kinds[:3] == (WINDOW, WINDOW, SHARED) and cfg.layer_kinds.count(SHARED) == 38
    sh = cfg.shared
    assert sh.kv_sources == (2, 8, 14, 20) and sh.index_sources == (2, 8, 14, 20, 24, 28, 32, 36)
    assert [sh.kv_source_of(i) for i in (2, 7, 8, 19, 20, 39)] == [2, 2, 8, 14, 20, 20]
    assert [sh.index_source_of(i) for i in (21, 24, 27, 39)] == [20, 24, 24, 36]
    assert sh.uses_candidates(24) and not sh.uses_candidates(20) and not sh.uses_candidates(14)
    e = cfg.engram
    assert e.layer_ids == (1, 14) and e.rows == (384_006_168, 384_016_682) and e.columns == 24 and e.row_bytes == 264
    assert [sum(p) for p in e.primes()] == list(e.rows) and min(e.primes()[0]) > 16_000_000
    ds = cfg.dspark
    assert (ds.stages, ds.n_routed_experts, ds.num_experts_per_tok, ds.target_layer_ids) == (3, 128, 3, (37, 38, 39))
    assert cfg.experts_of(40) == (128, 3) and cfg.experts_of(39) == (384, 6)
    assert cfg.vision.num_hidden_layers == 32 and cfg.vision.hidden_size == 1024


def test_released_tensor_list_matches_the_release_ledger():
    """Counts and bytes per dtype of the released checkpoint's headers, as a third party's read of
    all 48 shard headers records them (bojieli/OpenTallas data/inventory/deepseek-v4.1-flash.json):
    a BF16/FP8 swap or a missing scale that cancels in the total still moves this split."""
    cfg = release_cfg()
    specs = list(model_specs(cfg))
    by = {s.name: s for s in specs}
    counts, nbytes = Counter(), Counter()
    for s in specs:
        if s.kind == "scale":
            w = by[s.of]
            shape = w.scale_shape(w.dtypes[0], cfg.fp8_block)
            if shape is None:
                continue  # a BF16 weight has no scale
            dt = "F8_E8M0"
        else:
            dt, shape = s.dtypes[0], s.stored_shape(s.dtypes[0])
        counts[dt] += 1
        nbytes[dt] += math.prod(shape) * ITEMSIZE[dt]
    assert dict(counts) == {"BF16": 520, "F32": 387, "F8_E4M3": 357, "F8_E8M0": 47589, "I8": 47232}
    assert dict(nbytes) == {
        "BF16": 3_952_883_712,
        "F32": 169_229_128,
        "F8_E4M3": 204_015_223_296,
        "F8_E8M0": 23_563_015_184,
        "I8": 278_585_671_680,
    }
    assert sum(counts.values()) == 96_085 and sum(nbytes.values()) == 510_286_023_000
    t = trunk_nbytes(cfg, include_mtp=True)
    # the ledger's dense bytes read per token (main layers + final norm + head) and the drafter's
    assert t["trunk"] + t["head"] == 8_522_921_408 and t["mtp"] == 713_428_872
    assert t["embed"] == t["head"] == 129280 * 5120 * 2
    assert cfg.engram.table_bytes == 202_758_032_400
    assert cfg.total_expert_bytes == 295_997_276_160


def test_per_layer_structure_of_the_release():
    names = {s.name for s in model_specs(release_cfg(), with_experts=False)}

    def layers(suffix: str) -> list[int]:
        return sorted(int(n.split(".")[1]) for n in names if n.startswith("layers.") and n.endswith(suffix))

    assert layers("attn.compressor.wkv.weight") == [2, 8, 14, 20]
    assert layers("attn.compressor.norm.weight") == [2, 8, 14, 20]
    assert layers("attn.compressor.wgate.weight") == [2, 8, 14]
    assert layers("attn.indexer.wq_b.weight") == [2, 8, 14, 20, 24, 28, 32, 36]
    assert layers("attn.indexer.wq_b.scale") == [2, 8, 14, 20, 24, 28, 32, 36]
    assert layers("attn.indexer.weights_proj.weight") == [2, 8, 14, 20, 24, 28, 32, 36]
    assert layers("attn.indexer.wk.weight") == [2, 8, 14, 20]
    assert layers("attn.indexer.k_norm.weight") == [2, 8, 14, 20]
    assert layers("ffn.gate.bias_vl") == list(range(40)) and layers("ffn.gate.bias") == list(range(40))
    assert layers("engram.wkv.weight") == [1, 14] and layers("engram.q_weight") == [1, 14]
    assert not [n for n in names if "tid2eid" in n or n.endswith(".ape") or n.startswith("hc_head")]
    # the streamed tables are not part of the dense trunk
    assert not [n for n in names if ".engram.embed." in n]
    assert "mtp.0.main_proj.weight" in names and "mtp.1.main_proj.weight" not in names
    assert "mtp.2.markov_head.embed.weight" in names and "mtp.2.confidence_head.proj.weight" in names
    assert "mtp.0.ffn.gate.bias_vl" in names and not [n for n in names if n.startswith("mtp.") and "compressor" in n]
    vision = [n for n in names if spec_v41.is_vision(n)]
    assert len([n for n in vision if n.startswith("vision.")]) == 259 and len(vision) == 259 + 4 + 3


def test_layer_plan_reproduces_the_release():
    text = released()["text_config"]
    assert all(text[k] == v for k, v in synth_v41.layer_plan(40).items())


def test_tiny_v41_validates_and_lays_out_shards_as_the_release(tiny_v41):
    cat = Catalog.open(tiny_v41)
    cat.validate()
    cfg = cat.config
    assert cfg.family == V41 and cfg.vision is not None and cfg.engram is not None
    kinds = {cfg.ratio(i) for i in range(cfg.n_layers)}
    assert kinds == {0, 1, 2}
    # an expert's scales sit in one run, its weights in another, not next to each other
    w = cat.entry("layers.3.ffn.experts.1.w1.weight")
    sc = cat.entry("layers.3.ffn.experts.1.w1.scale")
    assert w.path == sc.path and abs(w.offset - sc.offset) > 4 * w.nbytes
    # each Engram module alone in its shard, the table's scale array after all its rows
    for layer in cfg.engram.layer_ids:
        rows = cat.entry(f"layers.{layer}.engram.embed.weight")
        scale = cat.entry(f"layers.{layer}.engram.embed.scale")
        shard = {e.name for e in read_header(Path(rows.path))}
        assert all(".engram." in n for n in shard)
        assert scale.offset >= rows.offset + rows.nbytes
        assert rows.shape == (cfg.engram.table_rows(layer), cfg.engram.head_dim)
        assert scale.shape == (cfg.engram.table_rows(layer), cfg.engram.head_dim // 32)
    # DSpark stages with their own experts, and the vision tower, present
    assert cat.has("mtp.2.ffn.experts.3.w2.weight") and not cat.has("mtp.2.ffn.experts.4.w2.weight")
    assert cat.has("vision.blocks.1.mlp.w1.weight") and cat.has("image_newline")


def test_other_layer_plans_and_seeds_generate_valid_checkpoints(tmp_path):
    plan = synth_v41.layer_plan(7, window=1, encoder=2, kv_group=1, index_every=2, mtp=1, targets=2)
    p = synth.make_checkpoint(
        tmp_path / "ck", "tiny-v41", seed=7, hidden_size=96, engram_n_heads=3, vision_config=None, **plan
    )
    cat = Catalog.open(p)
    cat.validate()
    cfg = cat.config
    assert cfg.n_layers == 7 and cfg.vision is None and cfg.engram.columns == 9
    assert not [n for n in cat.entries if "bias_vl" in n or n.startswith("vision.")]


# ---- refusals ---------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_header(shard: Path, edit) -> None:
    """Edit a shard's JSON header in place, keeping the data section where it was."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n, "header grew"
    shard.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n :])


def _problems_of(ck: Path) -> str:
    msg = str(pytest.raises(CheckpointError, Catalog.open(ck).validate).value)
    assert "\n" not in msg
    return msg


def test_refuses_a_missing_tensor(tiny_v41, tmp_path):
    ck = _copy(tiny_v41, tmp_path / "ck")
    cat = Catalog.open(ck)
    shard = Path(cat.entry("layers.6.attn.indexer.wk.weight").path)
    _rewrite_header(shard, lambda h: h.pop("layers.6.attn.indexer.wk.weight"))
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    index["weight_map"].pop("layers.6.attn.indexer.wk.weight")
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "'layers.6.attn.indexer.wk.weight': missing" in _problems_of(ck)


def test_refuses_a_misshaped_tensor(tiny_v41, tmp_path):
    ck = _copy(tiny_v41, tmp_path / "ck")
    shard = Path(Catalog.open(ck).entry("layers.1.engram.q_weight").path)

    def edit(h):
        h["layers.1.engram.q_weight"]["shape"] = list(reversed(h["layers.1.engram.q_weight"]["shape"]))

    _rewrite_header(shard, edit)
    msg = _problems_of(ck)
    assert "'layers.1.engram.q_weight': shape [64, 4], expected [4, 64]" in msg


def test_refuses_an_extra_tensor_and_a_wrong_block_size(tiny_v41, tmp_path):
    ck = _copy(tiny_v41, tmp_path / "ck")
    d = json.loads((ck / "config.json").read_text())
    d["quantization_config"]["weight_block_size"] = [64, 64]
    (ck / "config.json").write_text(json.dumps(d))
    assert "'layers.0.attn.wq_a.scale': shape [1, 2], expected [1, 1]" in _problems_of(ck)
    # a layer the config says is not a kv source keeps its compressor: a tensor nobody expects
    d["quantization_config"]["weight_block_size"] = [32, 32]
    d["text_config"]["kv_source_layer_ids"] = [2, 6]
    d["text_config"]["engram_layer_ids"] = [1, 2]  # layer 4 was the second Engram layer
    (ck / "config.json").write_text(json.dumps(d))
    msg = _problems_of(ck)
    assert "tensor(s) that config.json does not describe" in msg


def test_refuses_scales_of_the_other_format(tiny_v41, tmp_path):
    ck = _copy(tiny_v41, tmp_path / "ck")
    d = json.loads((ck / "config.json").read_text())
    d["quantization_config"]["scale_fmt"] = None  # says F32 scales; the shards hold E8M0
    (ck / "config.json").write_text(json.dumps(d))
    assert "dtype F8_E8M0, expected F32 (quantization_config.scale_fmt null)" in _problems_of(ck)


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: d["text_config"].update(compress_ratios=[0, 0, 4] + [2] * 17 + [1] * 20 + [0] * 3), "0, 1 or 2"),
        (lambda d: d["text_config"].update(kv_source_layer_ids=[8, 14, 20]), "no kv source of ratio 2"),
        (lambda d: d["text_config"].update(index_source_layer_ids=[8, 14, 20]), "kv source layer 2 is not in"),
        (lambda d: d["text_config"].update(candidate_source_layer_id=21), "is not an index source"),
        (lambda d: d["text_config"].update(index_topk=20000), "the candidate pool ((candidate_topk_blocks - 1)"),
        (lambda d: d["text_config"].update(engram_num_embeddings=[384006168, 384016683]), "bucket primes"),
        (lambda d: d["text_config"].update(engram_layer_ids=[14, 1]), "in order"),
        (lambda d: d["text_config"].update(num_nextn_predict_layers=2), "expected num_hidden_layers"),
        (lambda d: d["text_config"].update(rms_norm_eps=1e300), "'text_config.rms_norm_eps' must be at most"),
        (lambda d: d["text_config"].update(hc_sinkhorn_iters=10**9), "'text_config.hc_sinkhorn_iters' must be at most"),
        (lambda d: d["text_config"].update(n_routed_experts=10**9), "'text_config.n_routed_experts' must be at most"),
        (lambda d: d["text_config"].update(topk_method="greedy"), "'text_config.topk_method' must be 'noaux_tc'"),
        (lambda d: d["text_config"].update(model_type="deepseek_v4"), "'text_config.model_type'"),
        (lambda d: d["text_config"].pop("kv_source_layer_ids"), "missing 'text_config.kv_source_layer_ids'"),
        (lambda d: d["text_config"].update(surprise=1), "unknown key 'text_config.surprise'"),
        (lambda d: d.update(text_config=[]), "'text_config'"),
        (lambda d: d.update(quantization_config=None), "'quantization_config'"),
        (lambda d: d["quantization_config"].pop("expert_dtype"), "missing 'quantization_config.expert_dtype'"),
        (lambda d: d.update(eos_token_id=[1, "x"]), "'eos_token_id'"),
        (lambda d: d.update(image_token_id=200000), "'image_token_id'"),
        (lambda d: d["vision_config"].update(model_type="siglip"), "'vision_config.model_type'"),
    ],
)  # fmt: skip
def test_bad_v41_configs_are_one_line(edit, words):
    d = released()
    edit(d)
    t0 = time.perf_counter()
    msg = str(pytest.raises(ConfigError, ModelConfig.from_dict, d, "config.json").value)
    assert time.perf_counter() - t0 < 5
    assert words in msg and "\n" not in msg and msg.startswith("config.json: ")


def test_too_many_implied_tensors_are_refused_before_listing_them(tiny_v41, tmp_path):
    ck = _copy(tiny_v41, tmp_path / "ck")
    d = json.loads((ck / "config.json").read_text())
    d["text_config"]["n_routed_experts"] = 4096
    (ck / "config.json").write_text(json.dumps(d))
    t0 = time.perf_counter()
    msg = _problems_of(ck)
    assert time.perf_counter() - t0 < 5
    assert "config.json implies at least" in msg and "but the shards hold" in msg


def test_tiny_v41_carries_a_small_tokenizer_whose_engram_classes_the_config_counts(tiny_v41):
    import tokenizers

    from dsv4stream.engram.vocab import token_classes

    cfg = ModelConfig.from_json(tiny_v41 / "config.json")
    tok = tokenizers.Tokenizer.from_file(str(tiny_v41 / "tokenizer.json"))
    tc = token_classes(tok)
    assert tok.get_vocab_size() == cfg.vocab_size and tc.n_classes == cfg.engram.compressed_vocab_size
    assert 3 < tc.n_classes < cfg.vocab_size  # probes collapse: a real map, not an identity
    the = [tok.token_to_id("".join(synth_v41._byte_chars()[b] for b in w.encode())) for w in ("the", "The", " the")]
    assert len({int(tc.classes[i]) for i in the}) == 1


def test_output_gain_scales_exactly_the_residual_projections(tmp_path):
    a = Catalog.open(synth.make_checkpoint(tmp_path / "a", "tiny-v41", seed=5, tokenizer=False))
    b = Catalog.open(synth.make_checkpoint(tmp_path / "b", "tiny-v41", seed=5, tokenizer=False, output_gain_log2=-4))
    moved = set()
    for name in a.entries:
        x, y = a.read(name), b.read(name)
        if (x == y).all():
            continue
        assert name.endswith(".scale"), name
        assert (x.astype(int) - y.astype(int) == 4).all(), name  # E8M0 exponents, 2^-4 exactly
        moved.add(name)
    assert "layers.3.attn.wo_b.scale" in moved and "layers.1.engram.wkv.scale" in moved
    assert "layers.9.ffn.shared_experts.w2.scale" in moved and "layers.0.ffn.experts.5.w2.scale" in moved
    assert not [n for n in moved if n.endswith(("w1.scale", "w3.scale", "wq_a.scale", "engram.embed.scale"))]


def test_exact_structure_preset_writes_experts_and_engram_tables_as_holes(tmp_path):
    # flash-v41's code path (FP8 codes for the dense trunk, sparse experts and tables, the
    # release's 48-shard layout with embed and head alone) at tiny dims, so it runs in seconds.
    text = {**synth_v41._TINY_TEXT, "moe_intermediate_size": 256, "engram_vocab_size": 400}
    vision = synth_v41.PRESETS_V41["tiny-v41"]["top"]
    p = synth.make_checkpoint(tmp_path / "ck", "flash-v41", seed=3, **text, **vision)
    cat = Catalog.open(p)
    cat.validate()
    cfg = cat.config
    holes: Counter[str] = Counter()
    for name, e in cat.entries.items():
        if ".experts." in name and "shared" not in name or ".engram.embed." in name:
            assert not cat.read(name).view("uint8").any(), name
            holes[e.path] += e.nbytes
        elif name.endswith(".weight") and e.dtype == "F8_E4M3":
            assert cat.read(name).view("uint8").any(), name  # the dense trunk is real
    for path, nbytes in holes.items():
        st = Path(path).stat()
        assert st.st_blocks * 512 <= st.st_size - nbytes // 2, path  # most of the holes take no disk
    shards = sorted({e.path for e in cat.entries.values()})
    first = {n for n, e in cat.entries.items() if e.path == shards[0]}
    assert first == {"embed.weight"}
    head = {n for n, e in cat.entries.items() if e.path == cat.entry("head.weight").path}
    assert head == {"head.weight", "norm.weight"}
    assert len(shards) == 1 + cfg.n_layers + cfg.n_mtp + 1 + 1 + len(cfg.engram.layer_ids)
