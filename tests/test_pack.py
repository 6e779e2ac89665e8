"""Packed trunk: byte-for-byte round trip, alignment, resume after SIGKILL, and every refusal."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dsv4stream import synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.cli.pack import pack_trunk_cmd
from dsv4stream.errors import BudgetError, CheckpointError, UsageError
from dsv4stream.trunkpack import writer as pack
from dsv4stream.trunkpack.format import MANIFEST, TRUNK_FILE, plan_runs
from dsv4stream.trunkpack.packdir import staging_dir
from dsv4stream.trunkpack.reader import TrunkFile
from dsv4stream.trunkpack.writer import pack_trunk

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "model", "head"]  # mtp.* is not run: not packed


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return synth.make_checkpoint(tmp_path_factory.mktemp("p") / "ckpt", "tiny", seed=0)


@pytest.fixture(scope="module")
def cat(ckpt) -> Catalog:
    return Catalog.open(ckpt)


@pytest.fixture(scope="module")
def packed(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("p") / "trunk"
    r = pack_trunk(ckpt, out, progress=False)
    assert r.written == tuple(KEYS) and r.skipped == () and r.path == out
    return out


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def non_expert(cat: Catalog) -> set[str]:
    return {n for n in cat.entries if ".ffn.experts." not in n and not n.startswith("mtp.")}


# ---- layout and round trip ------------------------------------------------------------


def test_round_trip_byte_for_byte(packed, cat):
    with TrunkFile.open(packed, cat, verify=True) as tf:
        assert set(tf.names) == non_expert(cat)
        assert list(tf.runs) == KEYS and tf.complete and tf.layers_packed == 4
        for name in tf.names:
            want = cat.read(name)
            for got in (tf.tensor(name), tf.read_tensor(name)):
                assert (got.dtype, got.shape) == (want.dtype, want.shape)
                assert got.tobytes() == want.tobytes(), name
        for key in KEYS:
            arrs = tf.arrays(key)
            assert {n: a.tobytes() for n, a in arrs.items()} == {n: cat.read(n).tobytes() for n in arrs}
        assert tf.layer_run(2).key == "layers.2" and tf.layer_run(4) is None and tf.layer_run(9) is None
        assert tf.run("embed").tensors[0].name == "embed.weight"


def test_alignment_padding_and_checksums(packed, cat):
    m = json.loads((packed / MANIFEST).read_text())
    data = (packed / TRUNK_FILE).read_bytes()
    assert m["fingerprint"] == cat.fingerprint and len(data) == m["file_bytes"]
    used = np.zeros(len(data), bool)
    pos = 0
    for r in m["runs"]:
        assert r["offset"] == pos and r["offset"] % 4096 == 0 and r["nbytes"] % 4096 == 0
        pos += r["nbytes"]
        chunk = data[r["offset"] : r["offset"] + r["nbytes"]]
        assert hashlib.blake2b(chunk, digest_size=16).hexdigest() == r["blake2b"]
        for t in r["tensors"]:
            assert t["offset"] % 64 == 0 and r["offset"] <= t["offset"] < r["offset"] + r["nbytes"]
            used[t["offset"] : t["offset"] + t["nbytes"]] = True
    assert pos == len(data)
    assert not np.frombuffer(data, np.uint8)[~used].any()  # padding is zeros
    with TrunkFile.open(packed, cat) as tf:
        assert tf.read_run("layers.1").ctypes.data % 4096 == 0


def test_default_out_dir_and_up_to_date(ckpt, tmp_path):
    c = tmp_path / "ck"
    shutil.copytree(ckpt, c)
    r = pack_trunk(c, progress=False)
    assert r.path == c / "dsv4-trunk" and (c / "dsv4-trunk" / MANIFEST).exists()
    assert Catalog.open(c).problems() == []  # the pack inside the checkpoint does not disturb it
    again = pack_trunk(c, progress=False)
    assert again.up_to_date and again.written == ()


def test_partial_pack(ckpt, cat, tmp_path):
    out = tmp_path / "part"
    r = pack_trunk(ckpt, out, layers=2, progress=False)
    assert r.written == ("embed", "layers.0", "layers.1", "model", "head")
    tf = TrunkFile.open(out, cat, verify=True)
    assert not tf.complete and tf.layers_packed == 2
    assert tf.has("layers.1.attn.wq_a.weight") and not tf.has("layers.2.attn.wq_a.weight")
    assert not tf.has("mtp.0.e_proj.weight") and tf.layer_run(2) is None
    with pytest.raises(CheckpointError, match="not in this trunk"):
        tf.entry("layers.2.attn.wq_a.weight")
    with pytest.raises(UsageError, match="--layers 5"):
        pack_trunk(ckpt, tmp_path / "x", layers=5, progress=False)
    with pytest.raises(UsageError, match="--force"):  # another pack is there: not silently replaced
        pack_trunk(ckpt, out, progress=False)
    r = pack_trunk(ckpt, out, progress=False, force=True)
    assert TrunkFile.open(out, cat).complete and not (tmp_path / ".part.old").exists()


# ---- resume ------------------------------------------------------------------------------

CHILD = """
import sys, time
from dsv4stream.trunkpack.writer import pack_trunk
n = 0
def hook(key, written):
    global n
    n += written
    if n == 3:
        print("PAUSED", flush=True)
        time.sleep(60)
pack_trunk(sys.argv[1], sys.argv[2], progress=False, on_run=hook)
"""


def test_resume_after_sigkill(ckpt, cat, packed, tmp_path):
    out = tmp_path / "trunk"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ckpt), str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert child.stdout.readline().strip() == "PAUSED"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    stage = staging_dir(out)
    assert stage.is_dir() and not out.exists()
    with pytest.raises(CheckpointError, match="interrupted pack"):  # a half-written pack is never used
        TrunkFile.open(out, cat)
    journal = [json.loads(x) for x in (stage / "journal.jsonl").read_text().splitlines()]
    assert [d["key"] for d in journal[1:]] == KEYS[:3]
    # damage one journaled run: the resume must rewrite it, and keep the other two
    m_run1 = plan_runs(cat)[1]
    flip(stage / TRUNK_FILE, m_run1.tensors[-1].offset + 5)
    seen = []
    r = pack_trunk(ckpt, out, progress=False, on_run=lambda k, w: seen.append((k, w)))
    assert r.skipped == ("embed", "layers.1") and r.written == ("layers.0", *KEYS[3:])
    assert sorted(seen) == sorted([(k, k in r.written) for k in KEYS])
    assert not stage.exists()
    assert (out / TRUNK_FILE).read_bytes() == (packed / TRUNK_FILE).read_bytes()
    a, b = (json.loads((d / MANIFEST).read_text()) for d in (out, packed))
    assert a == b
    TrunkFile.open(out, cat, verify=True)


def test_stale_staging_from_another_plan_is_discarded(ckpt, cat, packed, tmp_path):
    out = tmp_path / "trunk"
    stage = staging_dir(out)
    stage.mkdir()
    (stage / TRUNK_FILE).write_bytes(b"\x55" * 10000)
    (stage / "journal.jsonl").write_text('{"plan": "other"}\n{"key": "embed", "blake2b": "00"}\n')
    r = pack_trunk(ckpt, out, progress=False)
    assert r.skipped == () and (out / TRUNK_FILE).read_bytes() == (packed / TRUNK_FILE).read_bytes()


# ---- refusals ---------------------------------------------------------------------------


def test_refuses_corrupted_run(packed, cat, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    tf = TrunkFile.open(bad, cat)
    run = tf.run("layers.1")
    big = max(run.tensors, key=lambda t: t.nbytes)  # not the small tensor `open` compares
    flip(bad / TRUNK_FILE, big.offset + big.nbytes // 2)
    tf = TrunkFile.open(bad, cat)  # cheap open does not hash everything...
    with pytest.raises(CheckpointError, match=r"run 'layers\.1' .* fails its checksum"):
        tf.read_run("layers.1")  # ...but every run load does
    with pytest.raises(CheckpointError, match="fails its checksum"):
        tf.arrays("layers.1")
    with pytest.raises(CheckpointError, match=r"layers\.1"):
        tf.verify()
    with pytest.raises(CheckpointError, match="trunk is corrupted"):
        TrunkFile.open(bad, cat, verify=True)
    tf.read_run("layers.0")  # the others still load
    probe = min(tf.run("layers.2").tensors, key=lambda t: (t.nbytes, t.name))
    flip(bad / TRUNK_FILE, probe.offset)
    with pytest.raises(CheckpointError, match="differs from"):
        TrunkFile.open(bad, cat)
    with open(bad / TRUNK_FILE, "r+b") as f:
        f.truncate(4096)
    with pytest.raises(CheckpointError, match="truncated"):
        TrunkFile.open(bad, cat)
    (bad / MANIFEST).write_text("{")
    with pytest.raises(CheckpointError, match="the manifest is not valid JSON"):
        TrunkFile.open(bad, cat)


def test_refuses_trunk_of_another_checkpoint(packed, tmp_path):
    other = Catalog.open(synth.make_checkpoint(tmp_path / "o", "tiny", seed=0, dense_dtype="bf16"))
    with pytest.raises(CheckpointError, match="packed from a different checkpoint"):
        TrunkFile.open(packed, other)
    # same shapes, other weights (like a base and a chat model): same header fingerprint
    twin = Catalog.open(synth.make_checkpoint(tmp_path / "t", "tiny", seed=7))
    with pytest.raises(CheckpointError, match="another checkpoint with the same shapes"):
        TrunkFile.open(packed, twin)
    with pytest.raises(CheckpointError, match="no packed trunk here"):
        TrunkFile.open(tmp_path / "none", twin)


def test_disk_space_check(ckpt, cat, tmp_path, monkeypatch):
    data = sum(r.nbytes for r in plan_runs(cat))
    # exactly the trunk's bytes free: the manifest would not fit, so it must be refused up front
    monkeypatch.setattr(pack.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - data, data))
    out = tmp_path / "trunk"
    with pytest.raises(BudgetError) as ei:
        pack_trunk(ckpt, out, progress=False)
    msg = str(ei.value)
    assert "\n" not in msg and f"({data:,} bytes) is free" in msg and "more disk space" in msg
    need = int(msg.split("needs ")[1].split("(")[1].split(" bytes")[0].replace(",", ""))
    assert need > data  # the manifest and journal are counted too
    assert not out.exists() and not staging_dir(out).exists()


def test_refuses_broken_checkpoint(ckpt, tmp_path):
    c = tmp_path / "ck"
    shutil.copytree(ckpt, c)
    (c / "model-00003-of-00005.safetensors").write_bytes(b"\0" * 4)
    with pytest.raises(CheckpointError, match="too short"):
        pack_trunk(c, progress=False)
    assert not (c / "dsv4-trunk").exists() and not staging_dir(c / "dsv4-trunk").exists()


# ---- command line --------------------------------------------------------------------------


def test_cli_and_tool(ckpt, packed, tmp_path):
    out = tmp_path / "cli"
    r = CliRunner().invoke(pack_trunk_cmd, [str(ckpt), str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "7 runs, wrote 7" in r.stdout and "MB/s" in r.stdout
    assert (out / TRUNK_FILE).read_bytes() == (packed / TRUNK_FILE).read_bytes()
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "pack_trunk.py"), str(ckpt), str(out), "--layers", "1"],
        check=False, capture_output=True, text=True, timeout=60, env=dict(os.environ, COLUMNS="80"),
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith("dsv4: ") and "--force" in r.stderr
