"""Generated checkpoints: release layout (expert runs, residues, distances), shards, index, config schema."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv4stream import synth
from dsv4stream.checkpoint.catalog import INDEX_NAME, Catalog
from dsv4stream.checkpoint.tensors import expert_prefix
from dsv4stream.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
# Bigger than tiny: each FP4 expert weight is 64 KiB, a multiple of 4096, as in the release.
MEDIUM = {"hidden_size": 256, "moe_intermediate_size": 512, "n_routed_experts": 16, "vocab_size": 1024}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Catalog:
    return Catalog.open(synth.make_checkpoint(tmp_path_factory.mktemp("s") / "tiny", "tiny", seed=0))


@pytest.fixture(scope="module")
def medium(tmp_path_factory) -> Catalog:
    return Catalog.open(synth.make_checkpoint(tmp_path_factory.mktemp("s") / "medium", "tiny", seed=1, **MEDIUM))


def runs(cat: Catalog, names: list[str]) -> tuple[int, int]:
    """(start, end) of the named tensors, asserting they are back to back in one file."""
    es = sorted((cat.entries[n] for n in names), key=lambda e: e.offset)
    assert len({e.path for e in es}) == 1
    for a, b in itertools.pairwise(es):
        assert b.offset == a.end, f"{b.name} does not follow {a.name}"
    return es[0].offset, es[-1].end


def check_layout(cat: Catalog, release: bool = True) -> list[int]:
    """Assert the release layout for every (layer, expert); return the runs' start residues mod 4096.

    release: dense linears are FP8, so all of a layer's FP8 dense weights must lie between
    an expert's scale run and its weight run (variants only keep the runs separate).
    """
    cfg = cat.config
    residues = []
    for layer in range(cfg.n_layers + cfg.n_mtp):
        p0 = expert_prefix(cfg, layer, 0).rsplit("experts.", 1)[0]
        lp = p0.rsplit("ffn.", 1)[0]
        fp8 = sum(e.nbytes for n, e in cat.entries.items() if n.startswith(lp) and e.dtype == "F8_E4M3" and p0 not in n)
        assert fp8 > 0 or not release
        for x in range(cfg.n_routed_experts):
            p = expert_prefix(cfg, layer, x)
            s0, s1 = runs(cat, [f"{p}w{i}.scale" for i in (1, 2, 3)])
            w0, _w1 = runs(cat, [f"{p}w{i}.weight" for i in (1, 2, 3)])
            assert cat.entries[p + "w1.scale"].path == cat.entries[p + "w1.weight"].path
            # far apart: every FP8 dense weight of the layer sits between the two runs
            assert w0 - s1 > (fp8 if release else 0)
            residues += [s0 % 4096, w0 % 4096]
    return residues


def test_tiny_layout(tiny):
    res = check_layout(tiny)
    assert any(res) and len(set(res)) > 10


def test_medium_layout(medium):
    res = check_layout(medium)
    assert medium.entries["layers.0.ffn.experts.0.w1.weight"].nbytes == 65536
    assert any(r != 0 for r in res)


def test_shards_and_index_consistent(tiny):
    root = tiny.root
    idx = json.loads((root / INDEX_NAME).read_text())
    shards = sorted(p.name for p in root.glob("*.safetensors"))
    cfg = tiny.config
    assert len(shards) == cfg.n_layers + cfg.n_mtp
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(idx["weight_map"].values()) == set(shards)
    assert {n: Path(e.path).name for n, e in tiny.entries.items()} == idx["weight_map"]
    assert idx["metadata"]["total_size"] == tiny.nbytes
    # one shard per block: every layers.L tensor lives in shard L
    for n, e in tiny.entries.items():
        if n.startswith("layers."):
            assert Path(e.path).name == shards[int(n.split(".")[1])]


def test_mtp_block_and_dtypes(tiny):
    n = tiny.entries
    for name in ("mtp.0.e_proj.weight", "mtp.0.h_proj.scale", "mtp.0.enorm.weight", "mtp.0.hc_head_fn",
                 "mtp.0.attn.wq_a.weight", "mtp.0.ffn.experts.7.w3.weight", "mtp.0.ffn.gate.bias"):  # fmt: skip
        assert name in n, name
    assert not any(k.startswith("layers.4.") for k in n)
    dt = {k: e.dtype for k, e in n.items()}
    assert dt["embed.weight"] == dt["head.weight"] == "BF16"
    assert dt["layers.1.attn.wq_a.weight"] == "F8_E4M3" and dt["layers.1.attn.wq_a.scale"] == "F8_E8M0"
    assert dt["layers.1.attn.compressor.wkv.weight"] == "BF16"
    assert "layers.1.attn.compressor.wkv.scale" not in n
    assert dt["layers.1.ffn.experts.0.w1.weight"] == "I8" and dt["layers.0.ffn.gate.tid2eid"] == "I64"
    assert "layers.1.attn.indexer.compressor.ape" in n and "layers.2.attn.indexer.wq_b.weight" not in n
    tid = tiny.read("layers.0.ffn.gate.tid2eid")
    assert tid.shape == (512, 2) and tid.min() >= 0 and tid.max() < 8
    assert np.all(tid[:, 0] != tid[:, 1])  # distinct experts per token


def test_config_in_release_schema(tiny):
    got = json.loads((tiny.root / "config.json").read_text())
    want = json.loads(synth.FLASH_CONFIG.read_text())
    # the release's keys, plus one provenance record that loaders ignore
    assert set(got) == set(want) | {"dsv4stream_generator"}
    assert got["dsv4stream_generator"] == {"preset": "tiny", "seed": 0}
    assert got["quantization_config"] == want["quantization_config"]
    for k, v in synth.PRESETS["tiny"].items():
        assert got[k] == v


@pytest.mark.parametrize(
    "opts, check",
    [
        ({"scale_fmt": "float"}, {"layers.1.attn.wq_a.scale": "F32", "layers.1.ffn.experts.0.w1.scale": "F32"}),
        ({"compressor_dtype": "fp8"}, {"layers.1.attn.compressor.wkv.weight": "F8_E4M3",
                                        "layers.1.attn.compressor.wkv.scale": "F8_E8M0"}),
        ({"dense_dtype": "bf16"}, {"layers.1.attn.wq_a.weight": "BF16"}),
        ({"dense_dtype": "f32"}, {"layers.1.attn.wq_a.weight": "F32"}),
        ({"expert_dtype": "fp8"}, {"layers.1.ffn.experts.0.w1.weight": "F8_E4M3"}),
    ],
)  # fmt: skip
def test_variants_validate_clean(tmp_path, opts, check):
    cat = Catalog.open(synth.make_checkpoint(tmp_path / "v", "tiny", seed=0, **opts))
    assert cat.problems() == []
    for name, dt in check.items():
        assert cat.entries[name].dtype == dt
    if opts.get("scale_fmt") == "float":
        assert json.loads((cat.root / "config.json").read_text())["quantization_config"]["scale_fmt"] == "float"
    if "dense_dtype" in opts:
        assert "layers.1.attn.wq_a.scale" not in cat.entries
    check_layout(cat, release="dense_dtype" not in opts and "expert_dtype" not in opts)  # two runs in every variant


def test_deterministic_and_seeded(tmp_path, tiny):
    a = synth.make_checkpoint(tmp_path / "a", "tiny", seed=0)
    b = synth.make_checkpoint(tmp_path / "b", "tiny", seed=2)
    for shard in sorted(tiny.root.glob("*.safetensors")):
        assert (a / shard.name).read_bytes() == shard.read_bytes()
    assert (b / "model-00002-of-00005.safetensors").read_bytes() != (
        a / "model-00002-of-00005.safetensors"
    ).read_bytes()


def test_refusals(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(UsageError, match="not empty"):
        synth.make_checkpoint(tmp_path / "full")
    with pytest.raises(UsageError, match="unknown preset"):
        synth.make_checkpoint(tmp_path / "p", preset="huge")
    with pytest.raises(Exception, match="compress_ratios"):
        synth.make_checkpoint(tmp_path / "bad", compress_ratios=[0, 4])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no half-written directory left


def test_tool_script(tmp_path):
    out = tmp_path / "t"
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_tiny_checkpoint.py"), str(out), "--seed", "3",
         "--set", "num_hidden_layers=2", "--set", "compress_ratios=[4,16,0]", "--scale-fmt", "float"],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    cat = Catalog.open(out)
    assert cat.config.layer_kinds == ("csa", "hca") and cat.problems() == []
    assert cat.entries["layers.0.attn.wq_a.scale"].dtype == "F32"
