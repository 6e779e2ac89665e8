"""Where a pack may go and who may write it: OUT_DIR rules, the staging and lock paths.

Owns: recognising a pack of ours (its manifest's format marker, and nothing else in the
folder), refusing an OUT_DIR whose replacement could lose anything else, and the packer's
lock. `pack` does the packing.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .. import jsonio
from ..errors import Dsv4Error, UsageError
from ..files import kind_of
from .format import FORMAT_FAMILY, HEAD_Q8_FILE, JOURNAL, MANIFEST, TRUNK_FILE, valid_file_name

DEFAULT_DIRNAME = "dsv4-trunk"
PACK_FILES = frozenset({MANIFEST, TRUNK_FILE, HEAD_Q8_FILE, f".{HEAD_Q8_FILE}.tmp"})  # .tmp: an add cut short
STAGE_FILES = PACK_FILES | {JOURNAL, f"{MANIFEST}.tmp", "lock"}


def default_out_dir(ckpt_dir: str | os.PathLike) -> Path:
    return Path(ckpt_dir) / DEFAULT_DIRNAME


def staging_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.partial"


def old_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.old"


def lock_path(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.lock"


MANIFEST_LIMIT = 256 << 20  # a real manifest is well under 1 MB; bounds what a stray file costs


def read_manifest(d: Path) -> dict | None:
    """The manifest of a pack in `d` if it carries our format marker; None otherwise (a FIFO or
    device named manifest.json is not a manifest, and is never opened in a way that can block)."""
    try:
        m = jsonio.read_json(d / MANIFEST, "the manifest", max_bytes=MANIFEST_LIMIT)
    except (Dsv4Error, OSError):
        return None
    ok = isinstance(m, dict) and isinstance(m.get("format"), str) and m["format"].startswith(FORMAT_FAMILY)
    # a manifest whose data file is not a plain name inside the folder is not a pack of ours:
    # nothing may read or replace a file elsewhere on its word
    return m if ok and valid_file_name(m.get("file")) else None


def is_pack(d: Path) -> bool:
    """A folder that holds a pack of ours and nothing else (so replacing it loses nothing)."""
    try:
        names = {p.name for p in d.iterdir()}
    except OSError:
        return False
    return names <= PACK_FILES and read_manifest(d) is not None


def _inside(a: Path, b: Path) -> bool:
    """True when a is b or lies below it."""
    return a == b or b in a.parents


def check_out_dir(ckpt: Path, out: Path, force: bool) -> None:
    """Refuse an OUT_DIR whose replacement could lose something that is not a previous pack."""
    rc, ro = ckpt.resolve(), out.resolve()
    if _inside(rc, ro):
        raise UsageError(
            f"{out}: is the checkpoint or a folder holding it; choose a new OUT_DIR (default {default_out_dir(ckpt)})"
        )
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: is a file, not a pack; choose another OUT_DIR (nothing was changed)")
    for d in (out, staging_dir(out), old_dir(out)):
        _refuse_special(d)
    names = _names(out)
    if names and not is_pack(out):
        raise UsageError(
            f"{out}: holds files that are not a dsv4 trunk pack; choose a new or empty OUT_DIR"
            " (--force replaces only a previous pack, never other files)"
        )
    for side, allowed in ((staging_dir(out), STAGE_FILES), (old_dir(out), PACK_FILES)):
        names = _names(side)
        if (names is None and side.exists()) or (names is not None and not names <= allowed):
            raise UsageError(f"{side}: in the way and not left by pack-trunk; move it away or choose another OUT_DIR")


def _refuse_special(d: Path) -> None:
    """Anything in a pack folder that is not a regular file (a FIFO named manifest.json, a
    device, a link) is named before any file in it is opened: opening a FIFO would block."""
    try:
        entries = list(os.scandir(d))
    except (FileNotFoundError, NotADirectoryError):
        return
    for e in entries:
        if not e.is_file(follow_symlinks=False):
            kind = kind_of(e.stat(follow_symlinks=False).st_mode)
            raise UsageError(
                f"{e.path}: is {kind}, not a file a pack holds; remove it or choose another OUT_DIR (nothing was changed)"
            )


def _names(d: Path) -> set[str] | None:
    """The names in folder d; None when d is not a folder, or no longer there. Before the lock is
    taken another packer may rename or remove its staging folder between our looking and
    listing it (a vanished folder is not in the way; the check runs again under the lock)."""
    try:
        return {p.name for p in d.iterdir()}
    except (FileNotFoundError, NotADirectoryError):
        return None


def take_lock(path: Path, out: Path) -> int:
    """An exclusive flock on `path`, held by this process alone: a lock file unlinked by its
    previous holder is detected (inode changed) and taken afresh, so two packers never both
    believe they hold it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Dsv4Error(f"{out}: another pack-trunk is writing this pack; wait for it or stop it") from None
        st = os.fstat(fd)
        try:
            cur = os.stat(path)
        except FileNotFoundError:
            cur = None
        if cur is not None and (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
            return fd
        os.close(fd)


def drop_lock(path: Path, fd: int) -> None:
    """Unlink while still holding the lock (after the final rename), then release it."""
    try:
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def pack_hint(root: str | os.PathLike) -> str:
    """How to pack this checkpoint's trunk: beside it, or elsewhere when its folder is read-only."""
    if os.access(root, os.W_OK):
        return f"`dsv4 pack-trunk {root}` once makes start-up faster"
    return (
        f"{root} is read-only: `dsv4 pack-trunk {root} OUT_DIR` with OUT_DIR elsewhere,"
        " then --trunk OUT_DIR, makes start-up faster"
    )
