"""Aligned reads into slots: placement, EOF, truncation, and the O_DIRECT fallback."""

import dataclasses
import errno
import os
from pathlib import Path

import numpy as np
import pytest
from store_files import make_files, o_direct_refusal

from dsv4stream.errors import ReadError
from dsv4stream.store import directio
from dsv4stream.store.directio import ALIGN, FileSet, aligned_buffer, piece_views, plan_slot
from dsv4stream.store.runs import Piece, layout_pieces, merge_pieces


def read_layout(files, layout):
    plan = plan_slot(layout)
    buf = aligned_buffer(plan.nbytes)
    for w in plan.windows:
        files.read(w, buf)
    return piece_views(buf, layout, plan)


def check_all(files, layouts, truth):
    for layout in layouts.values():
        views = read_layout(files, layout)
        for p, v in zip(layout_pieces(layout), views, strict=True):
            assert v.shape == p.shape and v.dtype == p.dtype
            assert v.tobytes() == truth[p.name]


def test_aligned_buffer_is_aligned():
    for n in (1, 4096, 12345):
        b = aligned_buffer(n)
        assert b.ctypes.data % ALIGN == 0 and b.nbytes == n


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_reads_place_every_piece(tmp_path, io):
    layouts, truth = make_files(tmp_path)
    files = FileSet(io, warn=lambda m: None)
    check_all(files, layouts, truth)
    direct = files.is_direct(str(tmp_path / "shard-0.safetensors"))
    assert direct == (io == "direct" and not files.fallback_paths)
    files.close()


def test_o_direct_is_used_where_the_file_system_accepts_it(tmp_path):
    """The buffered fallback is for file systems that refuse O_DIRECT: where an aligned
    O_DIRECT read works, every file must be read with it."""
    refused = o_direct_refusal(tmp_path)
    if refused:
        pytest.skip(refused)
    layouts, truth = make_files(tmp_path)
    said = []
    files = FileSet("direct", warn=said.append)
    check_all(files, layouts, truth)
    paths = {r.path for lay in layouts.values() for r in lay}
    assert [files.is_direct(p) for p in sorted(paths)] == [True] * len(paths)
    assert files.fallback_paths == [] and said == []
    files.close()


def eof_layout(tmp_path: Path, size: int, cut: int = 0):
    """One 5000-byte piece ending exactly at EOF of a `size`-byte file (minus `cut`)."""
    path = tmp_path / "eof.bin"
    data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(data[: size - cut])
    piece = Piece("tail", size - 5000, 5000, np.dtype(np.uint8), (5000,))
    return merge_pieces([(str(path), piece)]), data[-5000:]


def test_window_past_end_of_file_is_fine(tmp_path):
    layout, want = eof_layout(tmp_path, 3 * ALIGN + 77)
    files = FileSet("direct", warn=lambda m: None)
    (view,) = read_layout(files, layout)
    assert view.tobytes() == want
    files.close()


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_truncated_file_raises_read_error_naming_file_and_offset(tmp_path, io):
    layout, _ = eof_layout(tmp_path, 3 * ALIGN + 77, cut=10)
    files = FileSet(io, warn=lambda m: None)
    with pytest.raises(ReadError, match=r"eof\.bin at offset 4096 needs 8269 bytes, got 8259"):
        read_layout(files, layout)
    files.close()


def test_a_truncated_packed_trunk_is_told_to_re_pack_a_shard_to_re_download(tmp_path):
    for name, advice in (("trunk.bin", "dsv4 pack-trunk"), ("model-00001-of-00002.safetensors", "re-download")):
        d = tmp_path / name.split(".")[0]
        d.mkdir()
        layout, _ = eof_layout(d, 3 * ALIGN + 77, cut=10)
        (d / "eof.bin").rename(d / name)
        layout = tuple(dataclasses.replace(r, path=str(d / name)) for r in layout)
        files = FileSet("buffered", warn=lambda m: None)
        with pytest.raises(ReadError) as err:
            read_layout(files, layout)
        files.close()
        msg = str(err.value)
        assert advice in msg and "rebuild the catalog" not in msg and name in msg


def refuse_direct(monkeypatch, where):
    """Make O_DIRECT fail with EINVAL on open or on read, as tmpfs did before Linux 6.6."""
    real_open, real_preadv = os.open, os.preadv
    direct_fds = set()

    def fake_open(path, flags, *a):
        if flags & os.O_DIRECT and where == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *a)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def fake_preadv(fd, bufs, off):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(directio.os, "open", fake_open)
    monkeypatch.setattr(directio.os, "preadv", fake_preadv)


@pytest.mark.parametrize("where", ["open", "read"])
def test_refused_o_direct_falls_back_and_says_so_once(tmp_path, monkeypatch, where):
    layouts, truth = make_files(tmp_path, files=3)
    refuse_direct(monkeypatch, where)
    said = []
    files = FileSet("direct", warn=said.append)
    check_all(files, layouts, truth)
    assert len(files.fallback_paths) == 3
    assert len(said) == 1 and "O_DIRECT refused" in said[0] and f"on {where} of" in said[0]
    files.close()


def test_dev_shm_reads_correctly_and_reports_fallback_at_most_once():
    # Linux >= 6.6 tmpfs accepts O_DIRECT; older kernels refuse it (EINVAL): both must work.
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    root = shm / f"dsv4-store-test-{os.getpid()}"
    root.mkdir()
    try:
        layouts, truth = make_files(root, layers=2, experts=3)
        said = []
        files = FileSet("direct", warn=said.append)
        check_all(files, layouts, truth)
        assert len(said) == (1 if files.fallback_paths else 0)
        files.close()
    finally:
        for p in root.iterdir():
            p.unlink()
        root.rmdir()
