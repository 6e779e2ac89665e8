"""The packed trunk's checksums and identity: reordered or flipped blocks are refused on every
read, a trunk.bin replaced during a run stops it, an older pack is upgraded only after its
strong hash passes, and the manifest may name no file outside the pack.

The block tests mutate trunk.bin the way a bad disk, a bad copy or a hand edit would (4 KiB
blocks swapped, permuted or bit-flipped anywhere, padding included) and then do what a run
does: open the pack and read every run. Whatever the mutation, if the bytes changed some
step must refuse."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from cli_runs import dsv4, dsv4_child, refused
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dsv4stream import synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.errors import CheckpointError, UsageError
from dsv4stream.trunkpack.format import FORMAT, MANIFEST, TRUNK_FILE
from dsv4stream.trunkpack.reader import TrunkFile
from dsv4stream.trunkpack.upgrade import upgrade_trunk
from dsv4stream.trunkpack.writer import pack_trunk

BLOCK = 4096


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    # a vocabulary large enough that embed and head are more than the slices the open compares with the shards
    c = synth.make_checkpoint(tmp_path_factory.mktemp("ti") / "ck", "tiny", seed=11, vocab_size=2048)
    pack_trunk(c, progress=False)
    return c


@pytest.fixture(scope="module")
def cat(ckpt) -> Catalog:
    return Catalog.open(ckpt)


@pytest.fixture(scope="module")
def original(ckpt) -> bytes:
    return (ckpt / "dsv4-trunk" / TRUNK_FILE).read_bytes()


@pytest.fixture
def pack(ckpt, tmp_path) -> Path:
    out = tmp_path / "pack"
    shutil.copytree(ckpt / "dsv4-trunk", out)
    return out


def read_everything(pack: Path, cat: Catalog) -> None:
    """What a run does with the pack: open it (the embedding is checked there), then read every run."""
    with TrunkFile.open(pack, cat) as tf:
        for key in tf.runs:
            tf.read_run(key)


def swap(data: bytearray, a: int, b: int) -> None:
    blk_a = bytes(data[a * BLOCK : (a + 1) * BLOCK])
    data[a * BLOCK : (a + 1) * BLOCK] = data[b * BLOCK : (b + 1) * BLOCK]
    data[b * BLOCK : (b + 1) * BLOCK] = blk_a


def blocks_of(tf: TrunkFile, key: str) -> range:
    r = tf.run(key)
    return range(r.offset // BLOCK, (r.offset + r.nbytes) // BLOCK)


# ---- the position-sensitive checksum ---------------------------------------------------------------


@pytest.mark.parametrize("key", ["head", "embed", "layers.2"])
def test_two_swapped_blocks_inside_one_run_are_refused(pack, cat, key):
    # a plain sum of the words (the old check) is the same after a swap: this is what it missed
    tf = TrunkFile.open(pack, cat)
    r = tf.run(key)
    big = max(r.tensors, key=lambda t: t.nbytes)
    # whole blocks of its largest tensor, away from the slices the open compares with the shards
    edge = 32 << 10 if len(r.tensors) == 1 else 0
    lo, hi = -(-(big.offset + edge) // BLOCK), (big.offset + big.nbytes - edge) // BLOCK
    blocks = list(range(lo, hi))
    assert len(blocks) >= 2
    data = bytearray((pack / TRUNK_FILE).read_bytes())
    a, b = blocks[0], blocks[-1]
    assert data[a * BLOCK : (a + 1) * BLOCK] != data[b * BLOCK : (b + 1) * BLOCK]
    swap(data, a, b)
    (pack / TRUNK_FILE).write_bytes(data)
    with pytest.raises(CheckpointError, match=rf"run '{key}'.*fails its checksum \(xxh3"):
        read_everything(pack, cat)


def test_a_run_read_in_part_is_checked_tensor_by_tensor(pack, cat):
    # with --gpu some matrices of a layer live in VRAM: the rest of the run is read in pieces
    tf = TrunkFile.open(pack, cat)
    r = tf.run("layers.1")
    t = max(r.tensors, key=lambda t: t.nbytes)
    whole = tf.read_run("layers.1")
    part = whole[t.offset - r.offset : t.offset - r.offset + t.nbytes].copy()
    tf.check_window(tf.path, t.offset, part)  # intact: passes
    part[len(part) // 2] ^= 1
    with pytest.raises(CheckpointError, match=rf"tensor '{t.name}' of run 'layers.1'.*xxh3"):
        tf.check_window(tf.path, t.offset, part)


def test_every_read_is_checked_not_only_the_first(pack, cat):
    tf = TrunkFile.open(pack, cat)
    tf.read_run("layers.3")
    r = tf.run("layers.3")
    t = max(r.tensors, key=lambda t: t.nbytes)
    with open(pack / TRUNK_FILE, "r+b") as f:
        f.seek(t.offset + 5)
        b = f.read(1)
        f.seek(t.offset + 5)
        f.write(bytes([b[0] ^ 0x80]))
    tf._identity = None  # the rewrite alone would stop it: here the second read's checksum must
    with pytest.raises(CheckpointError, match=r"run 'layers\.3'.*fails its checksum"):
        tf.read_run("layers.3")


mutations = st.one_of(
    st.tuples(st.just("permute"), st.lists(st.integers(0, 10**9), min_size=2, max_size=12, unique=True), st.randoms()),
    st.tuples(st.just("flip"), st.integers(0, 10**12), st.integers(0, 7)),
    st.tuples(st.just("swap"), st.integers(0, 10**9), st.integers(0, 10**9)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=mutations)
def test_any_permutation_or_flip_of_blocks_is_refused(pack, cat, original, m):
    data = bytearray(original)
    n_blocks = len(data) // BLOCK
    kind = m[0]
    if kind == "permute":
        picked = sorted({i % n_blocks for i in m[1]})
        order = list(picked)
        m[2].shuffle(order)
        old = {i: bytes(data[i * BLOCK : (i + 1) * BLOCK]) for i in picked}
        for dst, src in zip(picked, order, strict=True):
            data[dst * BLOCK : (dst + 1) * BLOCK] = old[src]
    elif kind == "flip":
        data[m[1] % len(data)] ^= 1 << m[2]
    else:
        swap(data, m[1] % n_blocks, m[2] % n_blocks)
    assume(data != original)  # swapping two identical blocks (zero padding) changes nothing
    (pack / TRUNK_FILE).write_bytes(data)
    with pytest.raises(CheckpointError, match="checksum|differs from"):
        read_everything(pack, cat)


# ---- the file's identity ---------------------------------------------------------------------------


def test_a_trunk_replaced_during_a_run_stops_it(pack, cat):
    tf = TrunkFile.open(pack, cat)
    tf.read_run("layers.0")
    tmp = pack / "new.bin"
    shutil.copyfile(pack / TRUNK_FILE, tmp)
    os.replace(tmp, pack / TRUNK_FILE)  # same bytes, another file
    with pytest.raises(CheckpointError, match=r"replaced or rewritten during this run \(its inode"):
        tf.read_run("layers.0")


def test_a_trunk_rewritten_in_place_during_a_run_stops_it(pack, cat):
    tf = TrunkFile.open(pack, cat)
    st0 = os.stat(pack / TRUNK_FILE)
    os.utime(pack / TRUNK_FILE, ns=(st0.st_atime_ns, st0.st_mtime_ns + 10**9))  # what any write does to mtime
    with pytest.raises(CheckpointError, match="modification time changed"):
        tf.read_run("layers.0")
    with pytest.raises(CheckpointError, match="replaced or rewritten"):
        tf.check_identity()


def test_embedding_rows_read_after_a_replacement_stop_the_run(ckpt, tmp_path):
    # a streamed run: the embedding is read row by row after the open, without a checksum per row
    from dsv4stream.run.runinfo import RunOptions
    from dsv4stream.run.runtime import Runtime

    c = tmp_path / "ck"
    shutil.copytree(ckpt, c)
    with Runtime.open(c, RunOptions(budget=int(3e9))) as rt:
        s = rt.session()
        list(rt.generate(s, [1, 2, 3], 2))
        data = c / "dsv4-trunk" / TRUNK_FILE
        shutil.copyfile(data, tmp_path / "x")
        os.replace(tmp_path / "x", data)
        with pytest.raises(CheckpointError, match="replaced or rewritten during this run"):
            list(rt.generate(rt.session(), [4, 5, 6], 2))


# ---- older packs -----------------------------------------------------------------------------------


def make_format_1(pack: Path) -> dict:
    """Turn a current pack into what the previous dsv4stream wrote (format 1, word sums)."""
    m = json.loads((pack / MANIFEST).read_text())
    new = json.loads(json.dumps(m))
    m["format"] = "dsv4-trunk/1"
    m.pop("fast_checksum", None)
    m.pop("head_q8", None)  # format 1 predates the int8 head copy
    (pack / "head-q8.bin").unlink(missing_ok=True)
    for r in m["runs"]:
        r["sum64"] = "0123456789abcdef"
        del r["xxh3"]
        for t in r["tensors"]:
            del t["xxh3"]
    (pack / MANIFEST).write_text(json.dumps(m, indent=1) + "\n")
    return new


def test_an_older_pack_is_refused_with_the_command_that_upgrades_it(pack, cat, ckpt):
    make_format_1(pack)
    with pytest.raises(CheckpointError, match=rf"format 'dsv4-trunk/1'.*`dsv4 upgrade-trunk {pack}`"):
        TrunkFile.open(pack, cat)
    r = dsv4("run", str(ckpt), "--trunk", str(pack), "--prompt-ids", "1,2", "--gen", "1", "--budget", "3")
    refused(r, "dsv4 upgrade-trunk", str(pack))


def test_upgrade_checks_blake2b_then_writes_the_new_sums(pack, cat, ckpt):
    want = make_format_1(pack)
    data_before = (pack / TRUNK_FILE).read_bytes()
    r = dsv4("upgrade-trunk", str(pack), "--no-progress", "--checkpoint", str(ckpt))
    assert r.returncode == 0, r.stderr
    assert f"upgraded from dsv4-trunk/1 to {FORMAT}" in r.stdout
    got = json.loads((pack / MANIFEST).read_text())
    assert got["format"] == FORMAT and got["runs"] == want["runs"]
    assert (pack / TRUNK_FILE).read_bytes() == data_before  # the data file is never written
    assert sorted(p.name for p in pack.iterdir()) == ["head-q8.bin", MANIFEST, TRUNK_FILE]  # the copy added
    assert "added the int8 head copy" in r.stdout
    read_everything(pack, cat)
    again = dsv4("upgrade-trunk", str(pack), "--no-progress", "--checkpoint", str(ckpt))
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_upgrade_of_a_corrupted_older_pack_changes_nothing(pack, cat, ckpt):
    make_format_1(pack)
    before = (pack / MANIFEST).read_bytes()
    tf_runs = json.loads(before)["runs"]
    head = next(r for r in tf_runs if r["key"] == "head")
    data = bytearray((pack / TRUNK_FILE).read_bytes())
    swap(data, head["offset"] // BLOCK, head["offset"] // BLOCK + 1)
    (pack / TRUNK_FILE).write_bytes(data)
    r = dsv4("upgrade-trunk", str(pack), "--no-progress", "--checkpoint", str(ckpt))
    refused(r, "run 'head' fails its blake2b checksum", "nothing was changed", "pack-trunk")
    assert (pack / MANIFEST).read_bytes() == before


def test_pack_trunk_over_an_older_pack_names_the_upgrade(ckpt, tmp_path):
    out = tmp_path / "old"
    shutil.copytree(ckpt / "dsv4-trunk", out)
    make_format_1(out)
    with pytest.raises(UsageError, match=rf"older format 'dsv4-trunk/1'; `dsv4 upgrade-trunk {out}`"):
        pack_trunk(ckpt, out, progress=False)


def test_upgrade_refuses_what_is_not_a_pack(tmp_path):
    with pytest.raises(UsageError, match="no manifest.json here"):
        upgrade_trunk(tmp_path)


# ---- the manifest's file name ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/hostname", "sub/trunk.bin", "", "..", ".", 7, None])
def test_the_manifest_may_name_only_a_plain_file_inside_the_pack(pack, cat, tmp_path, name):
    (tmp_path / "outside.bin").write_bytes((pack / TRUNK_FILE).read_bytes())
    m = json.loads((pack / MANIFEST).read_text())
    m["file"] = name
    (pack / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="is not a plain file name inside"):
        TrunkFile.open(pack, cat)


def test_force_never_reads_or_replaces_a_file_a_manifest_points_outside(ckpt, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(ckpt / "dsv4-trunk", out)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"keep me")
    m = json.loads((out / MANIFEST).read_text())
    m["file"] = str(victim)
    (out / MANIFEST).write_text(json.dumps(m))
    (out / TRUNK_FILE).unlink()
    with pytest.raises(UsageError, match="not a dsv4 trunk pack"):
        pack_trunk(ckpt, out, force=True, progress=False)
    assert victim.read_bytes() == b"keep me" and (out / MANIFEST).exists()


# ---- FIFOs where a pack's files should be ---------------------------------------------------------


def test_a_fifo_named_manifest_in_pack_trunks_output_is_named_not_waited_on(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / MANIFEST)
    t0 = time.monotonic()
    r = dsv4_child("pack-trunk", str(ckpt), str(out), "--no-progress", timeout=120)  # a hang times out
    refused(r, "manifest.json", "is a FIFO")
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("victim", [MANIFEST, TRUNK_FILE])
def test_a_fifo_in_a_pack_is_named_when_it_is_opened(pack, cat, victim):
    (pack / victim).unlink()
    os.mkfifo(pack / victim)
    with pytest.raises(CheckpointError, match="is a FIFO"):
        TrunkFile.open(pack, cat)


def test_a_fifo_in_pack_trunks_staging_folder_is_named(ckpt, tmp_path):
    out = tmp_path / "out"
    stage = tmp_path / ".out.partial"
    stage.mkdir()
    os.mkfifo(stage / "journal.jsonl")
    with pytest.raises(UsageError, match=r"journal\.jsonl: is a FIFO"):
        pack_trunk(ckpt, out, progress=False)
    assert np.array_equal(sorted(p.name for p in stage.iterdir()), ["journal.jsonl"])


# ---- an old manifest that does not hold (issue 40, items 11-12) ---------------------------------


def _same_shape_pair(m: dict) -> tuple[dict, dict]:
    """Two tensors of one dtype and shape in one run, with other bytes."""
    for r in m["runs"]:
        seen: dict = {}
        for t in r["tensors"]:
            k = (t["dtype"], tuple(t["shape"]))
            if k in seen:
                return seen[k], t
            seen[k] = t
    raise AssertionError("no two tensors of one shape")


def _swap_names(a: dict, b: dict) -> None:
    for field in ("name", "xxh3"):
        if field in a:
            a[field], b[field] = b[field], a[field]


def _old_manifest_edits(m: dict):
    """(what, manifest) with one inconsistency each, of several kinds."""

    def edited(what, fn):
        e = json.loads(json.dumps(m))
        fn(e)
        return what, e

    def run(e, key):
        return next(r for r in e["runs"] if r["key"] == key)

    yield edited(
        "a tensor past its run's end",
        lambda e: run(e, "layers.0")["tensors"][-1].update(
            offset=run(e, "layers.0")["offset"] + run(e, "layers.0")["nbytes"]
        ),
    )
    yield edited(
        "a tensor inside another run",
        lambda e: run(e, "layers.0")["tensors"][0].update(offset=run(e, "layers.1")["tensors"][0]["offset"]),
    )
    yield edited(
        "a tensor listed twice", lambda e: run(e, "layers.1")["tensors"].append(dict(run(e, "layers.0")["tensors"][0]))
    )
    yield edited("a run listed twice", lambda e: e["runs"].append(json.loads(json.dumps(run(e, "head")))))
    yield edited("a tensor's size", lambda e: run(e, "model")["tensors"][0].update(nbytes=8))
    yield edited("a tensor's shape", lambda e: run(e, "model")["tensors"][0].update(shape=[1, 1]))
    yield edited("a tensor's dtype", lambda e: run(e, "model")["tensors"][0].update(dtype="I64"))
    yield edited("a name not in the checkpoint", lambda e: run(e, "layers.0")["tensors"][0].update(name="layers.0.x"))
    yield edited("two runs overlapping", lambda e: run(e, "layers.1").update(offset=run(e, "layers.0")["offset"]))
    yield edited("two same-shape tensors swapped", lambda e: _swap_names(*_same_shape_pair(e)))
    yield edited(
        "a tensor listed in another layer's run",
        lambda e: run(e, "layers.1")["tensors"].append(run(e, "layers.0")["tensors"].pop()),
    )
    yield edited("a run of another layer", lambda e: run(e, "layers.1").update(layer=0))


def test_upgrade_refuses_an_inconsistent_old_manifest_and_changes_nothing(pack, cat, ckpt):
    good = make_format_1(pack)
    old = json.loads((pack / MANIFEST).read_text())
    for what, edited in _old_manifest_edits(old):
        text = json.dumps(edited, indent=1) + "\n"
        (pack / MANIFEST).write_text(text)
        with pytest.raises(CheckpointError, match="nothing was changed") as e:
            upgrade_trunk(pack, checkpoint=ckpt)
        assert (pack / MANIFEST).read_text() == text, what
        assert "\n" not in str(e.value), what
    (pack / MANIFEST).write_text(json.dumps(old))
    upgrade_trunk(pack, checkpoint=ckpt)  # the faithful one still upgrades, to what the packer wrote
    assert json.loads((pack / MANIFEST).read_text())["runs"] == good["runs"]


def test_upgrade_needs_the_checkpoint_the_pack_came_from(pack, ckpt, tmp_path):
    make_format_1(pack)
    before = (pack / MANIFEST).read_bytes()
    with pytest.raises(UsageError, match="--checkpoint CHECKPOINT_DIR"):
        upgrade_trunk(pack)  # its parent is no checkpoint
    other = synth.make_checkpoint(tmp_path / "other", "tiny", seed=8)  # another vocabulary: another fingerprint
    with pytest.raises(UsageError, match="another checkpoint"):
        upgrade_trunk(pack, checkpoint=other)
    assert (pack / MANIFEST).read_bytes() == before


def test_verify_binds_each_tensor_to_its_name(pack, cat):
    m = json.loads((pack / MANIFEST).read_text())
    _swap_names(*_same_shape_pair(m))  # names and sums swapped: every checksum still holds
    (pack / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="differs from"):
        TrunkFile.open(pack, cat, verify=True)
