"""Catalog: offsets checked against the `safetensors` library's own reader, and every error case."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors
from safetensors import safe_open

from dsv4stream import synth
from dsv4stream.checkpoint.catalog import INDEX_NAME, Catalog, read_header
from dsv4stream.errors import CheckpointError, ConfigError

NP_OK = {"F32", "I64", "I32", "I8", "U8"}  # dtypes safe_open(framework="numpy") can return


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return synth.make_checkpoint(tmp_path_factory.mktemp("cat") / "ckpt", "tiny", seed=0)


@pytest.fixture
def copy(ckpt, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


# ---- a minimal safetensors writer, so tests can build what the library refuses to write ----


def load_shard(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, raw bytes), in file order, via the safetensors library."""
    return {n: (t["dtype"], list(t["shape"]), bytes(t["data"])) for n, t in safetensors.deserialize(path.read_bytes())}


def write_shard(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header, pos = {"__metadata__": {"format": "pt"}}, 0
    for name, (dt, shape, data) in tensors.items():
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        pos += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(t[2] for t in tensors.values()))


def shard_of(root: Path, name: str) -> Path:
    index = json.loads((root / INDEX_NAME).read_text())["weight_map"]
    return root / index[name]


def edit(root: Path, name: str, new: tuple[str, list[int], bytes] | None) -> Path:
    """Replace (or drop, with None) one tensor in its shard; keeps the index in step."""
    shard = shard_of(root, name)
    t = load_shard(shard)
    if new is None:
        del t[name]
        p = root / INDEX_NAME
        idx = json.loads(p.read_text())
        del idx["weight_map"][name]
        p.write_text(json.dumps(idx))
    else:
        t[name] = new
    write_shard(shard, t)
    return shard


# ---- the good case -----------------------------------------------------------------------


def test_offsets_match_the_safetensors_reader(ckpt):
    cat = Catalog.open(ckpt)
    assert cat.problems() == []
    cat.validate()
    seen = 0
    for shard in sorted(ckpt.glob("*.safetensors")):
        raw = dict(safetensors.deserialize(shard.read_bytes()))
        with safe_open(str(shard), framework="numpy") as f:
            keys = set(f.keys())
            assert keys == set(raw)
            for name in keys:
                e = cat.entries[name]
                assert Path(e.path) == shard
                sl = f.get_slice(name)
                assert (e.dtype, list(e.shape)) == (sl.get_dtype(), list(sl.get_shape()))
                mine = cat.read(name)
                assert mine.tobytes() == bytes(raw[name]["data"])
                if e.dtype in NP_OK:  # numpy has no F8 / BF16: those were compared via deserialize
                    assert mine.tobytes() == f.get_tensor(name).tobytes()
                with open(shard, "rb") as fh:  # the absolute offset points at those bytes
                    fh.seek(e.offset)
                    assert fh.read(e.nbytes) == mine.tobytes()
                seen += 1
    assert seen == len(cat.entries) > 400


def test_read_dtypes_and_helpers(ckpt):
    cat = Catalog.open(ckpt)
    assert cat.read("layers.1.attn.wq_a.weight").dtype == np.uint8
    assert cat.read("layers.1.attn.wq_a.scale").dtype == np.uint8
    assert cat.read("embed.weight").dtype == np.uint16
    assert cat.read("layers.0.ffn.gate.tid2eid").dtype == np.int64
    rows = np.array([5, 0, 511, 5])
    assert np.array_equal(cat.read_rows("embed.weight", rows), cat.read("embed.weight")[rows])
    with pytest.raises(CheckpointError, match="row 512 outside"):
        cat.read_rows("embed.weight", np.array([512]))
    q = cat.qweight("layers.1.attn.wq_a")
    assert (q.kind, q.rows, q.cols, q.scale.shape) == ("fp8", 32, 64, (1, 1))
    q = cat.qweight("layers.1.ffn.experts.3.w2")
    assert (q.kind, q.rows, q.cols, q.data.shape, q.scale.shape) == ("fp4", 64, 32, (64, 16), (64, 1))
    q = cat.qweight("layers.1.attn.compressor.wkv")
    assert (q.kind, q.scale) == ("bf16", None)
    assert cat.f32("layers.1.attn_norm.weight").dtype == np.float32
    with pytest.raises(CheckpointError, match="'nope.weight' is missing"):
        cat.read("nope.weight")


def test_fingerprint_is_stable_and_sees_layout(ckpt, tmp_path):
    a = Catalog.open(ckpt).fingerprint
    assert a == Catalog.open(ckpt).fingerprint
    other = synth.make_checkpoint(tmp_path / "o", "tiny", seed=0, dense_dtype="bf16")
    assert Catalog.open(other).fingerprint != a


def test_works_without_index(copy):
    (copy / INDEX_NAME).unlink()
    assert Catalog.open(copy).problems() == []


# ---- shard-level errors: refused at open, naming file and tensor -------------------------------


def last_tensor(shard: Path) -> str:
    return max(read_header(shard), key=lambda e: e.offset).name


def test_truncated_shard(copy):
    shard = sorted(copy.glob("*.safetensors"))[2]
    name = last_tensor(shard)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 3)
    msg = str(pytest.raises(CheckpointError, Catalog.open, copy).value)
    assert str(shard) in msg and f"'{name}'" in msg and "truncated" in msg
    with open(shard, "r+b") as f:
        f.truncate(5)
    assert "too short" in str(pytest.raises(CheckpointError, Catalog.open, copy).value)


def test_header_damage(copy):
    shard = min(copy.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[8] = ord("!")
    shard.write_bytes(bytes(data))
    assert "not valid JSON" in str(pytest.raises(CheckpointError, Catalog.open, copy).value)
    data[:8] = struct.pack("<Q", 1 << 40)
    shard.write_bytes(bytes(data))
    assert "does not fit" in str(pytest.raises(CheckpointError, Catalog.open, copy).value)


@pytest.mark.parametrize(
    "header, words",
    [
        ([1, 2], "header is not a JSON object"),
        ({"a": [1]}, "tensor 'a' has unsupported dtype None"),
        ({"a": {"dtype": "F32", "shape": [2]}}, "tensor 'a' has a malformed shape or data_offsets"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, "tensor 'a' has a malformed"),
        ({"a": {"dtype": "F32", "shape": "x", "data_offsets": [0, 8]}}, "tensor 'a' has a malformed"),
    ],
)
def test_malformed_header_entries(tmp_path, header, words):
    h = json.dumps(header).encode()
    p = tmp_path / "m.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + bytes(8))
    msg = str(pytest.raises(CheckpointError, read_header, p).value)
    assert str(p) in msg and words in msg


def test_unknown_dtype(copy):
    shard = edit(copy, "layers.1.attn_norm.weight", ("F8_E5M2", [128], bytes(128)))
    msg = str(pytest.raises(CheckpointError, Catalog.open, copy).value)
    assert str(shard) in msg and "'layers.1.attn_norm.weight'" in msg and "'F8_E5M2'" in msg


def test_span_disagrees_with_shape(copy):
    shard = edit(copy, "layers.1.attn_norm.weight", ("BF16", [64], bytes(100)))
    msg = str(pytest.raises(CheckpointError, Catalog.open, copy).value)
    assert str(shard) in msg and "spans 100 bytes but BF16 [64] needs 128" in msg


def test_duplicate_across_shards(copy):
    shards = sorted(copy.glob("*.safetensors"))
    norm = load_shard(shard_of(copy, "norm.weight"))["norm.weight"]
    write_shard(copy / "model-extra.safetensors", {"norm.weight": norm})
    msg = str(pytest.raises(CheckpointError, Catalog.open, copy).value)
    assert "'norm.weight'" in msg and "model-extra.safetensors" in msg and shards[-2].name in msg


def test_index_disagrees(copy):
    p = copy / INDEX_NAME
    good = p.read_text()
    idx = json.loads(good)
    idx["weight_map"]["norm.weight"] = "model-00001-of-00005.safetensors"
    p.write_text(json.dumps(idx))
    msg = str(pytest.raises(CheckpointError, Catalog.open, copy).value)
    assert "disagrees" in msg and "'norm.weight' listed in model-00001-of-00005.safetensors but found in" in msg
    idx = json.loads(good)
    del idx["weight_map"]["head.weight"]
    idx["weight_map"]["ghost.weight"] = "model-00001-of-00005.safetensors"
    p.write_text(json.dumps(idx))
    msg = str(pytest.raises(CheckpointError, Catalog.open, copy).value)
    assert "'ghost.weight'" in msg and "not in the index, first 'head.weight'" in msg
    idx["weight_map"]["ghost.weight"] = "model-00009-of-00009.safetensors"
    p.write_text(json.dumps(idx))
    assert "missing shard" in str(pytest.raises(CheckpointError, Catalog.open, copy).value)
    for bad in ("{}", '{"weight_map": [1]}', "[]"):
        p.write_text(bad)
        assert "not a valid index" in str(pytest.raises(CheckpointError, Catalog.open, copy).value)


def test_bad_config(copy):
    p = copy / "config.json"
    d = json.loads(p.read_text())
    del d["hidden_size"], d["index_topk"]
    p.write_text(json.dumps(d))
    msg = str(pytest.raises(ConfigError, Catalog.open, copy).value)
    assert str(p) in msg and "missing 'hidden_size'" in msg and "missing 'index_topk'" in msg
    p.unlink()
    assert "config.json is missing" in str(pytest.raises(ConfigError, Catalog.open, copy).value)


def test_missing_dir_and_no_shards(tmp_path):
    assert "not found" in str(pytest.raises(CheckpointError, Catalog.open, tmp_path / "nope").value)
    shutil.copy(synth.FLASH_CONFIG, tmp_path / "config.json")
    assert "no *.safetensors" in str(pytest.raises(CheckpointError, Catalog.open, tmp_path).value)


# ---- tensor-level problems: listed all at once against the config --------------------------


def test_tensor_problems_listed_together(copy):
    edit(copy, "layers.1.attn.wq_a.weight", None)  # missing weight
    edit(copy, "layers.2.attn.wkv.scale", None)  # missing scale of an FP8 weight
    edit(copy, "layers.1.attn.attn_sink", ("I32", [4], bytes(16)))  # wrong dtype
    edit(copy, "layers.3.attn_norm.weight", ("BF16", [63], bytes(126)))  # wrong shape
    edit(copy, "layers.0.ffn.experts.5.w1.weight", ("F8_E4M3", [32, 64], bytes(2048)))  # FP8 where FP4 ships
    edit(copy, "layers.1.ffn.experts.2.w3.scale", ("F8_E8M0", [32, 1], bytes(32)))  # scale shape
    cat = Catalog.open(copy)
    got = cat.problems()
    assert "'layers.1.attn.wq_a.weight': missing" in got
    assert "'layers.2.attn.wkv.scale': missing (needed by F8_E4M3 'layers.2.attn.wkv.weight')" in got
    assert "'layers.1.attn.attn_sink': dtype I32, expected one of F32/BF16" in got
    assert "'layers.3.attn_norm.weight': shape [63], expected [64]" in got
    assert "'layers.0.ffn.experts.5.w1.weight': dtype F8_E4M3, expected one of I8" in got
    assert "'layers.1.ffn.experts.2.w3.scale': shape [32, 1], expected [32, 2]" in got
    # the FP8 expert weight also makes its (FP4-shaped) scale wrong
    assert "'layers.0.ffn.experts.5.w1.scale': shape [32, 2], expected [1, 1]" in got
    assert len(got) == 7
    msg = str(pytest.raises(CheckpointError, cat.validate).value)
    assert "\n" not in msg and "7 tensor problem(s)" in msg and "(and 2 more)" in msg and str(copy) in msg


def test_unexpected_scale_for_bf16_weight(copy):
    shard = shard_of(copy, "layers.1.attn.compressor.wkv.weight")
    t = load_shard(shard)
    t["layers.1.attn.compressor.wkv.scale"] = ("F8_E8M0", [1, 1], bytes(1))
    write_shard(shard, t)
    (copy / INDEX_NAME).unlink()
    assert Catalog.open(copy).problems() == ["'layers.1.attn.compressor.wkv.scale': unexpected scale for a BF16 weight"]


# ---- headers that point tensors at the wrong bytes --------------------


def rewrite_offsets(shard: Path, change) -> None:
    """Rewrite the header in place (same length, data untouched); `change(header)` edits it."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    h = json.dumps(header, separators=(",", ":")).encode()
    assert len(h) <= n, "the edit must not grow the header"
    shard.write_bytes(raw[:8] + h + b" " * (n - len(h)) + raw[8 + n :])


def two_same_size(header: dict) -> tuple[str, str]:
    by_size: dict[int, list[str]] = {}
    for name, info in header.items():
        if name != "__metadata__":
            b, e = info["data_offsets"]
            by_size.setdefault(e - b, []).append(name)
    return next(tuple(v[:2]) for v in by_size.values() if len(v) >= 2)


@pytest.mark.parametrize(
    "how, why",
    [
        ("alias", "overlap"),  # one expert's tensor reads another's bytes
        ("shift", "overlap"),  # a tensor moved half into its neighbour
        ("negative", "malformed shape or data_offsets|outside the data section"),  # the header read as weights
        ("reversed", "outside the data section|spans"),
        ("negative_dim", "malformed shape"),
        ("float", "malformed shape"),
    ],
)
def test_refuses_headers_whose_tensors_do_not_own_their_bytes(copy, how, why):
    shard = sorted(copy.glob("*.safetensors"))[1]

    def change(h):
        a, b = two_same_size(h)
        ia, ib = h[a], h[b]
        ba, ea = ia["data_offsets"]
        if how == "alias":
            ib["data_offsets"] = [ba, ea]
        elif how == "shift":
            big = max((k for k in h if k != "__metadata__"), key=lambda k: -h[k]["data_offsets"][0])
            first = h[big]["data_offsets"]
            nxt = min((k for k in h if k != "__metadata__" and h[k]["data_offsets"][0] >= first[1]),
                      key=lambda k: h[k]["data_offsets"][0])  # fmt: skip
            width = h[nxt]["data_offsets"][1] - h[nxt]["data_offsets"][0]
            start = first[1] - 1
            h[nxt]["data_offsets"] = [start, start + width]
        elif how == "negative":
            ib["data_offsets"] = [ba - 64 - ea, -64]
        elif how == "reversed":
            ib["data_offsets"] = [ea, ba]
        elif how == "negative_dim":
            ib["shape"] = [-x for x in ib["shape"]]
        elif how == "float":
            ib["data_offsets"] = [float(x) for x in ib["data_offsets"]]

    rewrite_offsets(shard, change)
    with pytest.raises(CheckpointError, match=why) as e:
        Catalog.open(copy)
    assert "\n" not in str(e.value) and str(shard) in str(e.value)


@pytest.mark.parametrize("victim", ["shard", "index"])
def test_a_fifo_in_place_of_a_file_is_refused_not_waited_on(copy, victim):
    import os
    import subprocess
    import sys

    path = min(copy.glob("*.safetensors")) if victim == "shard" else copy / INDEX_NAME
    path.unlink()
    os.mkfifo(path)
    for cmd in (["inspect", str(copy)], ["pack-trunk", str(copy), "--no-progress"]):
        r = subprocess.run(
            [sys.executable, "-c", "from dsv4stream.cli import main; main()", *cmd],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert r.returncode == 2 and "is a FIFO, not a regular file" in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1
