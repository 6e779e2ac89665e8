"""The releases dsv4 accepts: V4-Flash (May preview), V4-Flash-0731 (DSpark drafter), V4-Pro
by config; and what it refuses (V4.1, shards that match neither layout).

Where the expected numbers come from (not from our code):
- 0731: 72,317 tensors, 166,878,536,440 bytes, 48 shards (its published index, as reported by
  public loaders); preview: 69,187 tensors, 46 shards.
- 0731 config keys (dspark_block_size 5, dspark_noise_token_id 128799, target layers 40-42,
  markov rank 256, 46 compress ratios with num_nextn_predict_layers 1) and the DSpark tensor
  shapes main_proj [4096, 12288], markov_w1/w2 [129280, 256], confidence_head.proj [1, 4352].
- V4-Pro: hidden 7168, 61 layers, 128 heads of 512, q_lora 1536, o_groups 16 x o_lora 1024,
  index_topk 1024, 384 experts of 3072, routed_scaling_factor 2.5, 62 compress ratios
  [128, 128, (4, 128) x 29, 4, 0] (its published config.json).
- The 0731 reasoning-effort prefixes: public ports of the 0731 `encoding_dsv4.py` (vLLM's
  patch tests, ds4-style C ports) pin "<BOS>Reasoning Effort: Beyond maximum" for max and the
  preview's "Absolute maximum" text for high; low adds nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dsv4stream import synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.checkpoint.config import DSPARK, PREVIEW, ModelConfig
from dsv4stream.checkpoint.spec import model_specs
from dsv4stream.checkpoint.tensors import released_nbytes
from dsv4stream.errors import CheckpointError, ConfigError, UsageError
from dsv4stream.run.planner import needs_from_config, plan
from dsv4stream.text import chat

PKG = Path(synth.__file__).resolve().parents[1]  # the package folder holding the config JSONs
FLASH = json.loads((PKG / "v4_flash_config.json").read_text())
PRO = json.loads((PKG / "v4_pro_config.json").read_text())
FLASH_0731 = {
    **FLASH,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0, 0, 0],
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [40, 41, 42],
    "dspark_markov_rank": 256,
}


def stored(cfg: ModelConfig) -> tuple[int, int]:
    """(tensors, bytes) of the checkpoint the config implies, with the release dtypes (a scale
    exists only beside an FP8 or FP4 weight)."""
    specs = list(model_specs(cfg))
    by_name = {s.name: s for s in specs}
    n = sum(1 for s in specs if s.kind != "scale" or by_name[s.of].dtypes[0] in ("F8_E4M3", "I8"))
    return n, sum(released_nbytes(cfg, s) for s in specs)


# ---- config ---------------------------------------------------------------------------
def test_0731_config_is_recognised():
    cfg = ModelConfig.from_dict(FLASH_0731)
    assert cfg.layout == DSPARK and cfg.n_mtp == 3 and cfg.num_nextn_predict_layers == 1
    assert cfg.dspark.target_layer_ids == (40, 41, 42) and cfg.dspark.markov_rank == 256
    assert cfg.n_layers == 43 and cfg.ratio(43) == cfg.ratio(45) == 0
    assert ModelConfig.from_dict(FLASH).layout == PREVIEW


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"dspark_target_layer_ids": [40, 43]}, "'dspark_target_layer_ids' should list distinct main layers 0..42"),
        ({"dspark_markov_rank": "256"}, "'dspark_markov_rank': input should be a valid integer"),
        ({"dspark_markov_rank": None}, "the dspark_\\* keys come together"),
        ({"compress_ratios": FLASH["compress_ratios"][:43]}, "need one more entry per drafter stage"),
        ({"dspark_noise_token_id": 129280}, "'dspark_noise_token_id' 129280 is outside the vocabulary"),
    ],
)
def test_bad_dspark_keys_are_named(patch, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**FLASH_0731, **patch})


def test_v41_keys_in_a_flat_config_are_refused_as_such():
    v41 = {**FLASH_0731, "model_type": "deepseek_v41", "num_hidden_layers": 40, "compress_ratios": [0] * 43}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(v41, source="x/config.json")
    msg = str(e.value)
    assert "a DeepSeek-V4.1 config.json nests the text model under 'text_config'" in msg and "\n" not in msg
    assert "shape" not in msg and "compress_ratios" not in msg  # refused before any field is read
    with pytest.raises(ConfigError, match="model_type 'llama' is not supported"):
        ModelConfig.from_dict({**FLASH, "model_type": "llama"})


# ---- the tensor lists against the published totals --------------------------------------
def test_0731_and_preview_tensor_counts_and_bytes():
    assert stored(ModelConfig.from_dict(FLASH_0731)) == (72_317, 166_878_536_440)
    assert stored(ModelConfig.from_dict(FLASH))[0] == 69_187


def test_dspark_tensor_shapes():
    cfg = ModelConfig.from_dict(FLASH_0731)
    specs = {s.name: s for s in model_specs(cfg, with_experts=False)}
    assert specs["mtp.0.main_proj.weight"].shape == (4096, 12288) and "mtp.0.main_proj.scale" in specs
    assert specs["mtp.2.markov_head.markov_w1.weight"].shape == (129280, 256)
    assert specs["mtp.2.markov_head.markov_w2.weight"].dtypes[0] == "BF16"
    assert specs["mtp.2.confidence_head.proj.weight"].shape == (1, 4352)
    assert "mtp.1.main_proj.weight" not in specs and "mtp.0.norm.weight" not in specs
    assert "mtp.0.e_proj.weight" not in specs and "mtp.1.attn.compressor.wkv.weight" not in specs
    assert all(f"mtp.{k}.ffn.gate.bias" in specs and f"mtp.{k}.hc_ffn_fn" in specs for k in range(3))
    assert len([s for s in model_specs(cfg) if s.name.startswith("mtp.1.ffn.experts.")]) == 256 * 6


# ---- V4-Pro by config ------------------------------------------------------------------
def test_pro_config_values():
    cfg = ModelConfig.from_dict(PRO)
    assert (cfg.hidden_size, cfg.n_layers, cfg.num_attention_heads, cfg.q_lora_rank) == (7168, 61, 128, 1536)
    assert (cfg.o_groups, cfg.o_lora_rank, cfg.index_topk, cfg.n_routed_experts) == (16, 1024, 1024, 384)
    assert (cfg.moe_intermediate_size, cfg.routed_scaling_factor) == (3072, 2.5)
    assert cfg.compress_ratios == (128, 128, *([4, 128] * 29), 4, 0) and cfg.layout == PREVIEW
    assert cfg.layer_kinds.count("csa") == 30 and cfg.layer_kinds.count("hca") == 31


def test_pro_only_shape_rules():
    """Shapes where Pro's dimensions tell apart rules that Flash's happen to satisfy alike."""
    cfg = ModelConfig.from_dict(PRO)
    specs = {s.name: s for s in model_specs(cfg, with_experts=False)}
    a = "layers.5.attn."
    # grouped output projection: o_groups*o_lora = 16384 rows (not hidden), heads*head_dim/o_groups cols
    assert specs[a + "wo_a.weight"].shape == (16384, 4096) and cfg.hidden_size == 7168
    assert specs[a + "wo_b.weight"].shape == (7168, 16384)
    assert specs[a + "wq_b.weight"].shape == (65536, 1536) and specs[a + "wq_a.weight"].shape == (1536, 7168)
    assert specs["layers.2.attn.indexer.wq_b.weight"].shape == (64 * 128, 1536)
    assert specs["layers.0.attn.compressor.wkv.weight"].shape == (512, 7168)  # ratio 128: no overlap halves
    assert specs["layers.2.attn.compressor.ape"].shape == (4, 1024)  # ratio 4: two halves
    assert specs["layers.3.ffn.gate.weight"].shape == (384, 7168)
    assert cfg.expert_bytes == 3 * (3072 * 7168 // 2 + 3072 * 7168 // 32)  # 35,094,528
    assert "layers.60.attn.indexer.wq_b.weight" in specs and "mtp.0.attn.compressor.wkv.weight" not in specs


def test_pro_plans_from_config(tmp_path):
    needs = needs_from_config(ModelConfig.from_dict(PRO))
    assert len(needs.layer_bytes) == 61 and needs.working_set == 61 * 6
    lines = plan(needs, 6 * 10**9).lines()
    assert any("MTP block (mtp.0): present, unused" in line for line in lines)


# ---- drafter: validated; budgeted unless --speculate off -----------------------------------
def test_planner_budgets_the_drafter_unless_off():
    pre = needs_from_config(ModelConfig.from_dict(FLASH))
    new = needs_from_config(ModelConfig.from_dict(FLASH_0731), speculate="off")
    assert (pre.layer_bytes, pre.head_bytes, pre.total_experts) == (new.layer_bytes, new.head_bytes, new.total_experts)
    assert plan(pre, 3 * 10**9).planned_bytes == plan(new, 3 * 10**9).planned_bytes
    assert new.unused == (
        "DSpark drafter (mtp.0-2, 3 stages): run by --speculate (default auto);"
        " with --speculate off not read, not budgeted, 10.86 GB"
    )
    on = needs_from_config(ModelConfig.from_dict(FLASH_0731))
    assert on.total_experts == new.total_experts + 3 * 256 and on.drafter_bytes > 0 and not on.unused
    assert plan(on, 12 * 10**9).planned_bytes >= plan(new, 12 * 10**9).planned_bytes


def test_config_estimate_counts_the_drafter_as_the_measured_plan(tiny0731):
    """`dsv4 inspect --config-only` (needs_from_config) and `dsv4 run` (measure) count the same
    drafter: its dense bytes (Markov embedding and confidence widened) and its stages' experts."""
    from dsv4stream.run.memory import measure
    from dsv4stream.run.runinfo import RunOptions

    cfg = Catalog.open(tiny0731).config
    for spec in ("auto", 2, "off"):
        est, got = needs_from_config(cfg, speculate=spec), measure(tiny0731, RunOptions(budget=1, speculate=spec))
        assert (est.drafter_bytes, est.total_experts) == (got.drafter_bytes, got.total_experts), spec
        assert (est.drafter_bytes > 0) == (spec != "off")


@pytest.fixture(scope="module")
def tiny0731(tmp_path_factory) -> Path:
    return synth.make_checkpoint(tmp_path_factory.mktemp("r") / "t", "tiny-0731", seed=3)


def test_generated_0731_validates(tiny0731):
    cat = Catalog.open(tiny0731)
    assert cat.config.layout == DSPARK and cat.problems() == []
    assert "mtp.2.markov_head.markov_w1.weight" in cat.entries and "mtp.0.e_proj.weight" not in cat.entries


def test_layout_mismatch_is_one_line(tiny0731, tmp_path):
    """0731 shards with the preview's config.json: what was found and what was expected, first."""
    c = tmp_path / "c"
    shutil.copytree(tiny0731, c)
    d = json.loads((c / "config.json").read_text())
    d = {k: v for k, v in d.items() if not k.startswith("dspark_")}
    d["compress_ratios"] = d["compress_ratios"][:5]
    (c / "config.json").write_text(json.dumps(d))
    p = Catalog.open(c).problems()
    assert p[0] == (
        "the shards hold the 0731 layout (a DSpark drafter under mtp.*) but config.json describes"
        " the preview layout (one MTP block under mtp.0) (config.json belongs to another release)"
    )
    with pytest.raises(CheckpointError, match="the shards hold the 0731 layout"):
        Catalog.open(c).validate()


def test_unknown_mtp_tensors_match_neither(tmp_path):
    """A checkpoint whose mtp.* is neither layout (an extra tensor, a missing marker) is named."""
    c = synth.make_checkpoint(tmp_path / "p", "tiny", seed=1)
    cat = Catalog.open(c)
    entries = {n: e for n, e in cat.entries.items() if n != "mtp.0.e_proj.weight"}
    p = Catalog(cat.root, cat.config, entries).problems()
    assert p[0].startswith("the shards hold unrecognised mtp.* tensors but config.json describes the preview")
    extra = dict(cat.entries, **{"mtp.0.markov_head.x": cat.entries["norm.weight"]})
    assert any("1 tensor(s) that config.json does not describe, first 'mtp.0.markov_head.x'" in x
               for x in Catalog(cat.root, cat.config, extra).problems())  # fmt: skip


def test_dspark_tensor_with_wrong_shape_is_named(tiny0731):
    cat = Catalog.open(tiny0731)
    e = cat.entries["mtp.0.main_proj.weight"]
    bad = dict(cat.entries, **{e.name: type(e)(e.name, e.path, e.offset, e.nbytes, e.dtype, (e.shape[1], e.shape[0]))})
    assert Catalog(cat.root, cat.config, bad).problems() == [
        "'mtp.0.main_proj.weight': shape [192, 64], expected [64, 192]"
    ]


def test_sparse_experts_keep_the_release_layout(tmp_path):
    """Holes instead of expert bytes: same headers (order, offsets) as the library writes, no disk."""
    dense = Catalog.open(synth.make_checkpoint(tmp_path / "d", "tiny-0731", seed=5, sparse_experts=False))
    sparse = Catalog.open(synth.make_checkpoint(tmp_path / "s", "tiny-0731", seed=5, sparse_experts=True))
    key = lambda c: {n: (Path(e.path).name, e.offset, e.nbytes, e.dtype, e.shape) for n, e in c.entries.items()}
    assert key(dense) == key(sparse) and sparse.problems() == []
    assert not sparse.read("layers.1.ffn.experts.3.w2.weight").any()
    assert sparse.read("layers.1.attn.wq_a.weight").any()
    for f in (tmp_path / "s").glob("*.safetensors"):
        assert os.stat(f).st_blocks * 512 < f.stat().st_size  # experts are holes


def test_exact_presets_shard_as_the_release():
    for preset, shards in (("flash", 46), ("flash-0731", 48)):
        cfg = ModelConfig.from_dict(synth.release_config(preset))
        groups = synth.v4.shard_groups(cfg, ends_alone=True)
        assert len(groups) == shards and [s.name for s in groups[0]] == ["embed.weight"]
        assert {s.name for s in groups[-1]} == {
            "norm.weight",
            "hc_head_fn",
            "hc_head_base",
            "hc_head_scale",
            "head.weight",
        }


def test_0731_runs_with_the_drafter_unused_when_off(tiny0731, tmp_path):
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime
    from dsv4stream.trunkpack.writer import pack_trunk

    r = pack_trunk(tiny0731, tmp_path / "trunk", progress=False)
    assert not [k for k in r.written if k.startswith("mtp.")]
    opts = RunOptions(budget=10**9, io="buffered", trunk=str(tmp_path / "trunk"), speculate="off")
    with Runtime.open(tiny0731, opts) as rt:
        ids = list(rt.generate(rt.session(), [0, 5, 9], 3, pick=lambda x: int(np.argmax(x))))
        s = rt.stats()
    assert len(ids) == 3
    assert s.unused.startswith(
        "DSpark drafter (mtp.0-2, 3 stages): run by --speculate (default auto); with --speculate off"
    )
    assert any(line.strip().startswith("DSpark drafter") for line in rt.plan.lines())
    # --speculate auto (the default) runs the 0731 drafter: planned, read from the shards
    with Runtime.open(tiny0731, replace(opts, speculate="auto")) as rt:
        assert list(rt.generate(rt.session(), [0, 5, 9], 3, pick=lambda x: int(np.argmax(x)))) == ids
        assert not rt.stats().unused and any("drafter: DSpark dense weights" in ln for ln in rt.plan.lines())


# ---- chat format -----------------------------------------------------------------------
B, U, A = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


def test_0731_reasoning_effort_vectors():
    msgs = [chat.Message("user", "solve it")]
    assert chat.render(msgs, "think") == chat.render(msgs, "think", effort="low") == B + U + "solve it" + A + "<think>"
    high = chat.render(msgs, "think", effort="high")
    assert high.startswith(B + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert high.endswith("left unchecked.\n\n" + U + "solve it" + A + "<think>")
    top = chat.render(msgs, "think", effort="max")
    assert top.startswith(B + "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n")
    assert top.endswith("no error remains undiscovered.\n\n" + U + "solve it" + A + "<think>")
    for e in ("low", "high", "max"):  # chat mode ignores the effort, as the official encoder does
        assert chat.render(msgs, "chat", effort=e) == B + U + "solve it" + A + "</think>"


def test_preview_reasoning_effort_kept():
    msgs = [chat.Message("system", "S"), chat.Message("user", "q")]
    assert chat.render(msgs, "think", effort="high", encoder="preview") == B + "S" + U + "q" + A + "<think>"
    assert chat.render(msgs, "think", effort="max", encoder="preview") == chat.render(msgs, "think", effort="high")
    with pytest.raises(UsageError, match="'low' is not one of high, max"):
        chat.render(msgs, "think", effort="low", encoder="preview")
    assert chat.encoder_for(PREVIEW) == "preview" and chat.encoder_for(DSPARK) == "0731"


@pytest.fixture(scope="module")
def chat0731(tmp_path_factory) -> Path:
    from dsv4stream.text.tokenizer import pack_tokenizer

    p = synth.make_checkpoint(
        tmp_path_factory.mktemp("r") / "c", "tiny-0731", seed=2, vocab_size=synth.REAL_VOCAB, tokenizer=True
    )
    pack_tokenizer(p)
    return p


def _run(*args: str, input: str | None = None):
    from click.testing import CliRunner

    from dsv4stream.cli.run import run as run_cmd

    return CliRunner().invoke(run_cmd, [*args, "--budget", "1"], input=input)


def test_cli_reasoning_effort(chat0731, tmp_path):
    from dsv4stream.text.tokenizer import Tokenizer

    tok = Tokenizer.load(chat0731)
    for effort in ("low", "high", "max"):
        out = tmp_path / f"{effort}.json"
        r = _run(str(chat0731), "--think", "--reasoning-effort", effort, "--prompt", "Hi", "--gen", "1",
                 "--greedy", "--stats-json", str(out))  # fmt: skip
        assert r.exit_code == 0, r.output
        want = tok.encode(chat.render(chat.one_turn("Hi"), "think", effort=effort, encoder="0731"))
        assert json.loads(out.read_text())["turn_prompt_tokens"] == [len(want)]
        assert "drafter: DSpark dense weights" in r.stderr  # --speculate auto runs the 0731 drafter
    r = _run(str(chat0731), "--prompt", "Hi", "--reasoning-effort", "max")
    assert isinstance(r.exception, UsageError) and "--reasoning-effort needs --think" in str(r.exception)
    r = _run(str(chat0731), "--chat", "--greedy", "--gen", "1", input="/think max\nHi\n/think low\n/think mid\n/quit\n")
    assert r.exit_code == 0, r.output
    assert "(thinking on, effort max)" in r.stderr and "(thinking on, effort low)" in r.stderr
    assert "reasoning effort 'mid' is not one of low, high, max" in r.stderr


def test_cli_preview_has_no_low_effort(tmp_path):
    from dsv4stream.text.tokenizer import pack_tokenizer

    p = synth.make_checkpoint(tmp_path / "p", "tiny", seed=2, vocab_size=synth.REAL_VOCAB, tokenizer=True)
    pack_tokenizer(p)
    r = _run(str(p), "--think", "--reasoning-effort", "low", "--prompt", "Hi")
    assert isinstance(r.exception, UsageError)
    assert "--reasoning-effort low: this checkpoint's chat format (preview) has high, max" in str(r.exception)


def test_inspect_plans_the_drafter(tiny0731, tmp_path):
    from click.testing import CliRunner

    from dsv4stream.cli.inspect import inspect

    r = CliRunner().invoke(inspect, [str(tiny0731), "--budget", "1"])
    assert r.exit_code == 0, r.output
    mtp = sum(e.nbytes for n, e in Catalog.open(tiny0731).entries.items() if n.startswith("mtp."))
    unused = (
        "DSpark drafter (mtp.0-2, 3 stages): run by --speculate (default auto); with --speculate off not read,"
        f" not budgeted, {mtp / 1e9:.2f} GB"
    )
    assert f"layout: the 0731 layout (a DSpark drafter under mtp.*); {unused}" in r.stdout
    assert "layers: 4 main + 3 DSpark stages;" in r.stdout and "  drafter: DSpark dense weights" in r.stdout
    r = CliRunner().invoke(inspect, ["--config-only", str(tiny0731), "--budget", "1"])  # the estimate plans it too
    assert r.exit_code == 0 and "  drafter: DSpark dense weights" in r.stdout, r.output
    (tmp_path / "config.json").write_text(json.dumps({**FLASH_0731, "model_type": "deepseek_v41"}))
    r = CliRunner().invoke(inspect, ["--config-only", str(tmp_path / "config.json")])
    assert isinstance(r.exception, ConfigError) and "nests the text model under 'text_config'" in str(r.exception)
