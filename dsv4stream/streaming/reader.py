"""Reading a trunk group: its aligned windows into one buffer, optionally re-read by the verifier.

Owns: `GroupReader` (O_DIRECT unless refused or --io buffered; counts reads, bytes and
time) and how the verifier's re-reads are cut into bounded parts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import Dsv4Error
from ..store import Layout
from ..store.directio import FileSet, piece_views
from ..store.runs import layout_pieces
from ..store.verify import Part, Verifier
from .layout import Group

VERIFY_CHUNK = 16 << 20  # bytes the verifier re-reads and compares at a time


class GroupReader:
    """Reads a group's aligned windows into a buffer (O_DIRECT unless refused or --io buffered),
    optionally re-reading every tensor through the independent Verifier; counts bytes and time."""

    def __init__(self, io: str, verify: bool, warn: Callable[[str], None] | None = None) -> None:
        self.files = FileSet(io, warn)
        self._verifier = Verifier() if verify else None
        self._lock = threading.Lock()
        self.reads = 0
        self.bytes_read = 0
        self.read_seconds = 0.0
        self.verified_reads = 0
        # check(path, file offset, bytes): the packed trunk's xxh3 of the runs (or tensors) read
        self.check: Callable[[str, int, np.ndarray], None] | None = None
        # same_file(path): the packed trunk's check that its file was not replaced since it was opened
        self.same_file: Callable[[str], None] | None = None

    def read(self, group: Group, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Fill `buf` (ALIGN-aligned, at least group.nbytes) and return name -> view."""
        t0 = time.perf_counter()
        n = 0
        try:
            for window in group.plan.windows:
                n += self.files.read(window, buf)
                if self.check is not None:
                    self.check(
                        window.path, window.file_offset, buf[window.slot_offset : window.slot_offset + window.nbytes]
                    )
        except Dsv4Error as e:
            raise type(e)(f"{group.label}: {e}") from e
        views = piece_views(buf, group.layout, group.plan)
        if self._verifier is not None:
            self._verifier.check(group.label, _verify_chunks(group.layout, views))
        with self._lock:
            self.reads += 1
            self.bytes_read += n
            self.read_seconds += time.perf_counter() - t0
            self.verified_reads += self._verifier is not None
        return {p.name: v for p, v in zip(layout_pieces(group.layout), views, strict=True)}

    def close(self) -> None:
        self.files.close()
        if self._verifier is not None:
            self._verifier.close()


def _verify_chunks(layout: Layout, views: Sequence[np.ndarray]) -> list[Part]:
    """The same bytes cut into parts of at most VERIFY_CHUNK, so that re-reading a 1 GB head
    costs VERIFY_CHUNK of memory, not three copies of it."""
    parts = []
    flat = [(run.path, p) for run in layout for p in run.pieces]
    for (path, p), v in zip(flat, views, strict=True):
        if p.nbytes <= VERIFY_CHUNK:
            parts.append(Part(path, p.name, 0, p.offset, v))
            continue
        raw = v.reshape(-1).view(np.uint8)
        for a in range(0, p.nbytes, VERIFY_CHUNK):
            parts.append(Part(path, p.name, a, p.offset + a, raw[a : a + VERIFY_CHUNK]))
    return parts
