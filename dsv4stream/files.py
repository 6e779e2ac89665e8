"""Opening inputs and writing outputs without hanging, truncating or losing anything.

Owns: what a path is before it is opened (`describe`: "a FIFO", "a directory", ...), opening
a file that must be a regular one without ever blocking on a FIFO or a device
(`open_regular`, `read_regular`), and writing an output atomically (`atomic_write`,
`AtomicFile`). Which outputs may not be written at all (files of a checkpoint, a pack, a kv
cache) is `cli/outputs.py`'s rule; this module knows no formats and imports nothing of the
project but its errors, so every layer may use it.

Why open with O_NONBLOCK and check with fstat, not stat then open: opening a FIFO for reading
blocks until a writer appears (a `manifest.json` FIFO hung pack-trunk forever); O_NONBLOCK
makes that open return at once, and fstat of the descriptor then says what was really opened,
so nothing can be swapped in between a check and the open.

Why temp file + rename for every output: `open(path, "w")` truncates at once, so a run that
fails after it (or a path that named a shard by mistake) leaves half a file or nothing. The
temporary file lives in the same folder (a rename across file systems is a copy), is flushed
and fsynced, and replaces the name in one step; on any error it is removed and the old file,
if any, is untouched.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO, Self

from .errors import Dsv4Error

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISREG, "a regular file"),
)


def kind_of(mode: int) -> str:
    """What a stat mode describes, in words ("a FIFO")."""
    return next((word for test, word in _KINDS if test(mode)), "an unknown kind of file")


def describe(path: str | os.PathLike) -> str | None:
    """What `path` is ("a FIFO", "a regular file", ...), following links; None when missing."""
    try:
        return kind_of(os.stat(path).st_mode)
    except FileNotFoundError:
        return None
    except OSError:
        return "unreadable"


def not_regular(path: str | os.PathLike, what: str, error: type[Dsv4Error] = Dsv4Error) -> Dsv4Error | None:
    """The error to raise when `path` exists and is not a regular file (None when it is one, or missing)."""
    kind = describe(path)
    if kind is None or kind == "a regular file":
        return None
    return error(f"{path}: {what} is {kind}, not a regular file; replace it with the real file")


def open_regular(
    path: str | os.PathLike, what: str, error: type[Dsv4Error] = Dsv4Error, flags: int = os.O_RDONLY
) -> int:
    """A descriptor of `path` opened with `flags`, refused (with one line naming what it is)
    unless it is a regular file; never blocks on a FIFO or a device."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise error(f"{path}: {what} is missing") from None
    except IsADirectoryError:
        raise error(f"{path}: {what} is a directory, not a regular file; replace it with the real file") from None
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise error(f"{path}: {what} is a FIFO, not a regular file; replace it with the real file") from None
        raise error(f"{path}: cannot open {what} ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: {what} is {kind_of(st.st_mode)}, not a regular file; replace it with the real file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(
    path: str | os.PathLike, what: str, error: type[Dsv4Error] = Dsv4Error, limit: int | None = None
) -> bytes:
    """The whole of a regular file; refused before reading anything when it is larger than `limit`."""
    fd = open_regular(path, what, error)
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise error(f"{path}: {what} is {size:,} bytes, more than the {limit:,} it may be; is it the right file?")
        chunks, got = [], 0
        while True:
            try:
                b = os.read(fd, 1 << 20)
            except OSError as e:
                raise error(f"{path}: cannot read {what} ({e.strerror})") from None
            if not b:
                return b"".join(chunks)
            got += len(b)
            if limit is not None and got > limit:  # grew while being read
                raise error(f"{path}: {what} is more than the {limit:,} bytes it may be; is it the right file?")
            chunks.append(b)
    finally:
        os.close(fd)


def _target(path: Path) -> Path:
    """The file a write to `path` must replace: a symbolic link is followed, so the link stays."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


class AtomicFile:
    """A file object for `path` that appears there only on `commit()` (or a clean `with` exit).

    Writes go to `.NAME.tmpPID` in the same folder; `commit` flushes, fsyncs and renames it
    over `path`; `discard` (or leaving the `with` block by an exception) removes it, and the
    old `path`, if any, is untouched."""

    def __init__(self, path: str | os.PathLike, mode: str = "w", **kw) -> None:
        if mode not in ("w", "wb"):
            raise ValueError(f"AtomicFile mode {mode!r}: only w and wb")
        self.path = _target(Path(path))
        self.tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:  # a file replaced keeps its permission bits
            os.fchmod(fd, stat.S_IMODE(os.stat(self.path).st_mode))
        except FileNotFoundError:
            pass
        self.file: IO = os.fdopen(fd, mode, **kw)
        self.done = False

    def write(self, data) -> int:
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def commit(self) -> Path:
        if self.done:
            return self.path
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        self.done = True
        return self.path

    def discard(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            self.file.close()
        finally:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write `data` to `path` atomically (see `AtomicFile`); returns the path written."""
    with AtomicFile(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return f.path


def state_dir() -> Path:
    """Where dsv4 keeps what it learns between runs (e.g. `--speculate auto`'s measured costs):
    DSV4_STATE_DIR, else $XDG_CACHE_HOME/dsv4stream, else ~/.cache/dsv4stream. Not the kernels'
    cache (`kernels.jit.cache_dir`), which lives with the package where it can."""
    root = os.environ.get("DSV4_STATE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv4stream"
