"""pack-trunk never loses what is not its own: OUT_DIR refusals, the lock, full disks, damaged packs."""

from __future__ import annotations

import errno
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsv4stream import synth
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.cli import cli
from dsv4stream.errors import BudgetError, Dsv4Error, UsageError
from dsv4stream.trunkpack import headcopy
from dsv4stream.trunkpack import writer as pack
from dsv4stream.trunkpack.format import MANIFEST, TRUNK_FILE, plan_runs
from dsv4stream.trunkpack.packdir import lock_path, staging_dir
from dsv4stream.trunkpack.reader import TrunkFile
from dsv4stream.trunkpack.writer import pack_trunk


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return synth.make_checkpoint(tmp_path_factory.mktemp("s") / "ckpt", "tiny", seed=0)


@pytest.fixture(scope="module")
def cat(ckpt) -> Catalog:
    return Catalog.open(ckpt)


@pytest.fixture(scope="module")
def keys(cat) -> tuple[str, ...]:
    return tuple(r.key for r in plan_runs(cat))


@pytest.fixture(scope="module")
def good(ckpt, tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("s") / "trunk"
    pack_trunk(ckpt, out, progress=False)
    return (out / TRUNK_FILE).read_bytes()


def listing(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def copy(ckpt: Path, tmp: Path) -> Path:
    c = tmp / "ck"
    shutil.copytree(ckpt, c)
    return c


# ---- OUT_DIR must be new, empty, or a previous pack -------------------------------------


def test_force_never_replaces_the_checkpoint_or_its_folder(ckpt, tmp_path):
    c = copy(ckpt, tmp_path)
    before = listing(tmp_path)
    for out in (c, tmp_path, c / "."):
        with pytest.raises(UsageError, match="is the checkpoint or a folder holding it"):
            pack_trunk(c, out, progress=False, force=True)
    assert listing(tmp_path) == before
    r = CliRunner().invoke(cli, ["pack-trunk", str(c), str(c), "--force", "--no-progress"])
    assert r.exit_code != 0 and listing(tmp_path) == before


def test_force_replaces_only_a_previous_pack(ckpt, cat, tmp_path):
    c = copy(ckpt, tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    inner = c / "original"  # a folder inside the checkpoint that is not a pack
    inner.mkdir()
    (inner / "config.json").write_text("{}")
    fake = tmp_path / "fake"  # looks like a pack by name and marker, but holds something else too
    fake.mkdir()
    (fake / MANIFEST).write_text('{"format": "dsv4-trunk/1"}')
    (fake / "model.safetensors").write_bytes(b"x")
    a_file = tmp_path / "file.bin"
    a_file.write_bytes(b"data")
    before = listing(tmp_path)
    for out, why in ((other, "not a dsv4 trunk pack"), (inner, "not a dsv4 trunk pack"),
                     (fake, "not a dsv4 trunk pack"), (a_file, "is a file")):  # fmt: skip
        with pytest.raises(UsageError, match=why):
            pack_trunk(c, out, progress=False, force=True)
    assert listing(tmp_path) == before
    # an earlier pack (of other --layers) is ours: --force replaces it
    prev = tmp_path / "prev"
    pack_trunk(c, prev, layers=1, progress=False)
    pack_trunk(c, prev, progress=False, force=True)
    assert TrunkFile.open(prev, cat).complete


def test_a_foreign_folder_where_the_old_pack_is_parked_is_refused(ckpt, tmp_path):
    out = tmp_path / "trunk"
    pack_trunk(ckpt, out, layers=1, progress=False)
    parked = tmp_path / ".trunk.old"
    parked.mkdir()
    (parked / "keep.txt").write_text("keep")
    with pytest.raises(UsageError, match="not left by pack-trunk"):
        pack_trunk(ckpt, out, progress=False, force=True)
    assert (parked / "keep.txt").read_text() == "keep"


def test_a_staging_folder_that_vanishes_while_checked_is_not_in_the_way(ckpt, tmp_path, monkeypatch):
    """Before the lock, another packer may finish and rename its staging folder between our
    seeing and listing it (a FileNotFoundError in a 4-packer run under load): not in the way."""
    from dsv4stream.trunkpack import packdir

    out = tmp_path / "trunk"
    side = staging_dir(out)
    side.mkdir()
    (side / "lock").write_text("")
    real = Path.iterdir

    def vanishing(self):
        if self == side and side.exists():
            shutil.rmtree(side)
        return real(self)

    monkeypatch.setattr(Path, "iterdir", vanishing)
    packdir.check_out_dir(ckpt, out, force=False)  # no FileNotFoundError, nothing refused
    foreign = staging_dir(tmp_path / "other")
    foreign.mkdir()
    (foreign / "keep.txt").write_text("keep")
    with pytest.raises(UsageError, match="not left by pack-trunk"):
        packdir.check_out_dir(ckpt, tmp_path / "other", force=False)


# ---- the lock is never unlinked before the rename ----------------------------------------


def test_a_second_packer_during_the_final_rename_cannot_break_the_pack(ckpt, cat, good, tmp_path, monkeypatch):
    out = tmp_path / "trunk"
    seen: list[BaseException | None] = []
    real = os.replace

    def replace(src, dst):
        if Path(src) == staging_dir(out) and not seen:
            try:  # another packer arrives exactly between the manifest and the rename
                pack_trunk(ckpt, out, progress=False)
                seen.append(None)
            except Dsv4Error as e:
                seen.append(e)
        return real(src, dst)

    monkeypatch.setattr(pack.os, "replace", replace)
    pack_trunk(ckpt, out, progress=False)
    assert seen and "another pack-trunk is writing" in str(seen[0])
    assert (out / TRUNK_FILE).read_bytes() == good
    TrunkFile.open(out, cat, verify=True)
    assert not lock_path(out).exists() and not staging_dir(out).exists()


def _packer(ckpt: str, out: str, barrier, q) -> None:
    barrier.wait()
    try:
        pack_trunk(ckpt, out, progress=False)
        q.put(0)
    except Dsv4Error:
        q.put(2)


def test_concurrent_packers_always_leave_a_complete_pack(ckpt, cat, good, tmp_path):
    mp = multiprocessing.get_context("fork")
    for trial in range(6):
        out = tmp_path / f"t{trial}"
        barrier, q = mp.Barrier(4), mp.Queue()
        procs = [mp.Process(target=_packer, args=(str(ckpt), str(out), barrier, q)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        rcs = sorted(q.get(timeout=5) for _ in procs)
        assert rcs[0] == 0 and set(rcs) <= {0, 2}, rcs
        assert (out / TRUNK_FILE).read_bytes() == good, trial
        TrunkFile.open(out, cat, verify=True)
        assert not staging_dir(out).exists() and not lock_path(out).exists()


# ---- a re-run: the packer recognises its own work ----------------------------------


def test_a_rerun_notices_a_corrupted_pack_and_repacks_it(ckpt, cat, good, keys, tmp_path):
    out = tmp_path / "trunk"
    pack_trunk(ckpt, out, progress=False)
    run = TrunkFile.open(out, cat).run("head")
    with open(out / TRUNK_FILE, "r+b") as f:
        f.seek(run.offset + run.nbytes // 2)
        b = f.read(1)
        f.seek(run.offset + run.nbytes // 2)
        f.write(bytes([b[0] ^ 1]))
    r = pack_trunk(ckpt, out, progress=False)
    assert not r.up_to_date and r.written == keys
    assert (out / TRUNK_FILE).read_bytes() == good
    assert pack_trunk(ckpt, out, progress=False).up_to_date


def test_a_pack_killed_after_its_manifest_is_finished_not_discarded(ckpt, cat, good, keys, tmp_path, monkeypatch):
    out = tmp_path / "trunk"
    real = os.replace

    def killed(src, dst):
        if Path(src) == staging_dir(out):
            raise KeyboardInterrupt  # the process dies here: manifest written, not yet renamed
        return real(src, dst)

    monkeypatch.setattr(pack.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        pack_trunk(ckpt, out, progress=False)
    monkeypatch.setattr(pack.os, "replace", real)
    said: list[str] = []
    monkeypatch.setattr(pack, "_say", lambda msg, progress: said.append(msg))
    r = pack_trunk(ckpt, out, progress=False)
    assert r.written == () and r.skipped == keys
    assert not any("another checkpoint" in m for m in said) and any("after its manifest" in m for m in said)
    assert (out / TRUNK_FILE).read_bytes() == good


# ---- a full disk -----------------------------------------------------------------------


def test_a_full_disk_names_the_space_and_the_resume_fits(ckpt, cat, good, tmp_path, monkeypatch):
    out = tmp_path / "trunk"
    runs = plan_runs(cat)
    total = runs[-1].offset + runs[-1].nbytes
    stop_at = runs[2].offset + runs[2].nbytes - 8192  # most of layers.1 is on disk when the disk fills
    real = os.pwrite

    def pwrite(fd, data, offset):
        if offset + len(data) > stop_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(pack.os, "pwrite", pwrite)
    with pytest.raises(BudgetError) as ei:
        pack_trunk(ckpt, out, progress=False)
    msg = str(ei.value)
    assert "no space left on device" in msg and "needs" in msg and "resumes" in msg and "\n" not in msg
    monkeypatch.setattr(pack.os, "pwrite", real)
    # what is left to write, plus room for a manifest and journal and the int8 head copy: the
    # resume must not be refused
    free = total - stop_at + (80 << 10) + headcopy.layout(*cat.entry("head.weight").shape)[1]
    monkeypatch.setattr(pack.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - free, free))
    r = pack_trunk(ckpt, out, progress=False)
    assert r.skipped == ("embed", "layers.0") and (out / TRUNK_FILE).read_bytes() == good
