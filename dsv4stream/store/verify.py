"""Independent check of what the fast path delivered: re-read each piece and compare bytes.

Owns its own descriptors (plain ``os.open``, no O_DIRECT) and its own arithmetic: it reads
``piece.nbytes`` bytes at ``piece.offset`` with ``os.pread`` and compares them with the
array the store handed out. It deliberately imports nothing from ``directio``: a
placement bug there (wrong residue, overlapping windows) must not be able to hide here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable, Sequence

import numpy as np

from dsv4stream.errors import ReadError, VerifyError

from .runs import Run


class Verifier:
    """Re-reads pieces through the page cache and compares them with delivered arrays."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = os.open(path, os.O_RDONLY)
                self._fds[path] = fd
            return fd

    def _pread_exact(self, path: str, offset: int, nbytes: int) -> bytes:
        fd = self._fd(path)
        chunks = []
        done = 0
        while done < nbytes:
            chunk = os.pread(fd, nbytes - done, offset + done)
            if not chunk:
                raise ReadError(
                    f"verify: {path} ends before offset {offset + done} "
                    f"(wanted {nbytes} bytes at {offset}); the file is truncated"
                )
            chunks.append(chunk)
            done += len(chunk)
        return b"".join(chunks)

    def check(self, key: Hashable, layout: Sequence[Run], arrays: Sequence[np.ndarray]) -> None:
        """Raise VerifyError unless ``arrays`` (layout order) hold exactly the file's bytes."""
        pieces = [(run.path, p) for run in layout for p in run.pieces]
        if len(pieces) != len(arrays):
            raise VerifyError(f"verify: {key}: layout has {len(pieces)} pieces, got {len(arrays)}")
        for (path, piece), arr in zip(pieces, arrays, strict=True):
            if arr.dtype != piece.dtype or arr.shape != piece.shape:
                raise VerifyError(
                    f"verify: {key} tensor {piece.name}: expected {piece.dtype}{piece.shape}, "
                    f"got {arr.dtype}{arr.shape}"
                )
            want = self._pread_exact(path, piece.offset, piece.nbytes)
            got = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
            if got.nbytes != len(want) or not np.array_equal(got, np.frombuffer(want, np.uint8)):
                bad = int(np.argmax(got != np.frombuffer(want, np.uint8)))
                raise VerifyError(
                    f"verify: {key} tensor {piece.name}: bytes differ from {path} at offset "
                    f"{piece.offset} (first difference at +{bad}); the fast read path "
                    "placed or read bytes wrongly"
                )

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
