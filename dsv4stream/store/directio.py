"""Aligned reads of item layouts into slot buffers: O_DIRECT with a buffered fallback.

Owns alignment (``ALIGN`` = 4096), slot planning, aligned buffer allocation, the file
descriptors, and the read loop. It does not own caching, threads or verification.

Placement (the invariant the whole store rests on): each run of a layout is widened to
its aligned window ``[floor(off/A)*A, ceil(end/A)*A)``; windows sit back to back in the
slot, each starting at a multiple of A, so a piece at file offset ``o`` lands at slot
offset ``window.slot_offset + (o - window.file_offset)``: the same residue mod A as ``o``.
Because windows never overlap, one run's window cannot overwrite an earlier run's bytes.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import ReadError, ShortReadError, StoreError
from .runs import Layout, layout_pieces

ALIGN = 4096
IO_MODES = ("direct", "buffered")

_log = logging.getLogger("dsv4stream.store")


@dataclass(frozen=True)
class Window:
    """One aligned read: ``nbytes`` of ``path`` from ``file_offset`` into the slot at
    ``slot_offset``; at least ``need`` bytes must arrive (the rest may lie past EOF)."""

    path: str
    file_offset: int
    nbytes: int
    slot_offset: int
    need: int


@dataclass(frozen=True)
class SlotPlan:
    """How one layout is read into a slot: its windows, and where each piece lands
    (slot byte offsets, in layout order). ``nbytes`` is the slot size it needs."""

    windows: tuple[Window, ...]
    piece_offsets: tuple[int, ...]
    nbytes: int


def plan_slot(layout: Layout) -> SlotPlan:
    """Aligned windows for ``layout``, back to back from slot offset 0 (see module doc)."""
    windows = []
    piece_offsets = []
    pos = 0
    for run in layout:
        start = run.offset // ALIGN * ALIGN
        stop = -(-run.end // ALIGN) * ALIGN
        windows.append(Window(run.path, start, stop - start, pos, run.end - start))
        piece_offsets.extend(pos + (p.offset - start) for p in run.pieces)
        pos += stop - start
    return SlotPlan(tuple(windows), tuple(piece_offsets), pos)


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A ``uint8`` array of ``nbytes`` whose first byte is ALIGN-aligned (over-allocate
    and offset; pages are only touched when first written)."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    shift = -raw.ctypes.data % ALIGN
    return raw[shift : shift + nbytes]


MADV_POPULATE_WRITE = 23  # linux/mman.h (Python's mmap module does not name it)
_madvise = None


class PagedBuffer:
    """A page-aligned anonymous mapping of ``nbytes`` (``array``: its ``uint8`` view) whose
    ranges can be handed back to the kernel (`release`): their pages leave the resident set
    at once and read as zeros when next touched. The expert store lends its slots' bytes to a
    prefill this way."""

    def __init__(self, nbytes: int) -> None:
        # private and anonymous: page-aligned, untouched pages cost nothing, and released ones are
        # freed (a shared mapping's pages would stay in memory as shmem)
        self._map = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self._map, dtype=np.uint8)[:nbytes]

    def populate(self, start: int, stop: int) -> bool:
        """Fault in the pages of ``[start, stop)`` now (MADV_POPULATE_WRITE, Linux 5.14+; the
        bytes already there stay); False where the kernel refuses. ctypes releases the GIL."""
        global _madvise
        if _madvise is None:
            try:
                _madvise = ctypes.CDLL(None, use_errno=True).madvise
                _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            except (OSError, AttributeError):
                _madvise = False
        page = mmap.PAGESIZE
        a, b = start // page * page, min(-(-stop // page) * page, len(self.array) // page * page)
        if not _madvise or b <= a:
            return False
        return _madvise(self.array.ctypes.data + a, b - a, MADV_POPULATE_WRITE) == 0

    def release(self, start: int, stop: int) -> None:
        """Drop the whole pages inside ``[start, stop)`` (their bytes are garbage from now on)."""
        page = mmap.PAGESIZE
        a, b = -(-start // page) * page, min(stop, len(self.array)) // page * page
        if b > a:
            self._map.madvise(mmap.MADV_DONTNEED, a, b - a)


def piece_views(buf: np.ndarray, layout: Layout, plan: SlotPlan) -> tuple[np.ndarray, ...]:
    """Zero-copy typed views of each piece of ``layout`` in ``buf`` (a slot), layout order."""
    return tuple(
        np.ndarray(p.shape, dtype=p.dtype, buffer=buf, offset=off)
        for p, off in zip(layout_pieces(layout), plan.piece_offsets, strict=True)
    )


def _refresh_advice(path: str) -> str:
    """What to do about a file that changed under us: re-pack ours, re-download the release's."""
    if os.path.basename(path) == "trunk.bin":
        return f"delete {os.path.dirname(path)} and run `dsv4 pack-trunk` again"
    return "re-download this shard"


class FileSet:
    """Open descriptors for the store's files, and the read of one window.

    ``io="direct"`` opens with O_DIRECT; where the file system refuses it (EINVAL on open
    or on the first read: tmpfs on older kernels, some network and FUSE file systems) the
    file is read through the page cache instead, and ``warn`` is called once per FileSet.
    ``io="buffered"`` uses the page cache on purpose. Descriptors are shared by reader
    threads: ``os.preadv`` carries its own offset and releases the GIL.
    """

    def __init__(self, io: str = "direct", warn: Callable[[str], None] | None = None) -> None:
        if io not in IO_MODES:
            raise StoreError(f"--io {io!r}: use one of {', '.join(IO_MODES)}")
        self.io = io
        self._warn = warn if warn is not None else _log.warning
        self._fds: dict[str, int] = {}
        self._direct: dict[str, bool] = {}
        self._retired: list[int] = []
        self._lock = threading.Lock()
        self.fallback_paths: list[str] = []

    def _open(self, path: str) -> tuple[int, bool]:
        with self._lock:
            fd = self._fds.get(path)
            if fd is not None:
                return fd, self._direct[path]
            direct = False
            if self.io == "direct":
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    direct = True
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise ReadError(f"cannot open {path}: {e.strerror}") from e
                    self._note_fallback(path, "open")
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise ReadError(f"cannot open {path}: {e.strerror}") from e
            self._fds[path] = fd
            self._direct[path] = direct
            return fd, direct

    def _note_fallback(self, path: str, where: str) -> None:
        self.fallback_paths.append(path)
        if len(self.fallback_paths) == 1:
            self._warn(
                f"O_DIRECT refused on {where} of {path}; reading through the page cache "
                "instead (said once; --io buffered silences this)"
            )

    def _reopen_buffered(self, path: str, fd: int) -> int:
        with self._lock:
            if self._fds.get(path) == fd and self._direct[path]:
                self._fds[path] = os.open(path, os.O_RDONLY)
                self._direct[path] = False
                self._note_fallback(path, "read")
                # Other threads may still be reading through the old fd: leave it open
                # until close() rather than racing them.
                self._retired.append(fd)
            return self._fds[path]

    def read(self, window: Window, slot: np.ndarray) -> int:
        """Read ``window`` into ``slot`` (an ALIGN-aligned uint8 buffer); returns bytes read.

        Loops over short reads; stops early only at end of file, and raises ReadError if
        fewer than ``window.need`` bytes arrived (ShortReadError)."""
        fd, direct = self._open(window.path)
        view = memoryview(slot)[window.slot_offset : window.slot_offset + window.nbytes]
        got = 0
        while got < window.nbytes:
            try:
                n = os.preadv(fd, [view[got:]], window.file_offset + got)
            except OSError as e:
                if direct and e.errno == errno.EINVAL:
                    fd = self._reopen_buffered(window.path, fd)
                    direct = False
                    continue
                raise ReadError(
                    f"read failed: {window.path} at offset {window.file_offset + got}: "
                    f"{e.strerror}; check the file and the disk"
                ) from e
            if n == 0:
                break
            got += n
        if got < window.need:
            raise ShortReadError(
                f"short read: {window.path} at offset {window.file_offset} needs "
                f"{window.need} bytes, got {got}: the file is shorter than when it was opened; "
                + _refresh_advice(window.path)
            )
        return got

    def is_direct(self, path: str) -> bool | None:
        """Whether ``path`` is read with O_DIRECT (None: not opened yet)."""
        return self._direct.get(path)

    def close(self) -> None:
        with self._lock:
            for fd in [*self._fds.values(), *self._retired]:
                os.close(fd)
            self._fds.clear()
            self._direct.clear()
            self._retired = []
