"""Embedding rows read on demand with pread: only the rows of the tokens asked for."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from ..checkpoint.catalog import NP_DTYPE, TensorEntry
from ..checkpoint.formats import bf16_to_f32
from ..errors import CheckpointError, ReadError, ShortReadError


class RowReader:
    """Rows of a 2-D tensor (the embedding) read on demand with pread: (T,) ids -> (T, D) float32."""

    def __init__(self, e: TensorEntry, after_read: Callable[[str], None] | None = None) -> None:
        self.e = e
        # after_read(path): the packed trunk's check that its file is still the one opened (a
        # row is too small to carry a checksum; the whole embedding was checked at open)
        self.after_read = after_read
        self.dtype = np.dtype(NP_DTYPE[e.dtype])
        self.row_bytes = int(np.prod(e.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self.fd = os.open(e.path, os.O_RDONLY)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        e = self.e
        ids = np.asarray(ids, dtype=np.int64)
        bad = ids[(ids < 0) | (ids >= e.shape[0])]
        if bad.size:
            raise CheckpointError(f"'{e.name}': row {int(bad[0])} outside 0..{e.shape[0] - 1}")
        # each distinct row once (a prompt repeats tokens); a long prompt's rows are announced
        # to the kernel first so their reads overlap instead of waiting one by one
        uniq, inv = np.unique(ids, return_inverse=True)
        offsets = [e.offset + int(r) * self.row_bytes for r in uniq]
        if len(offsets) > 1:
            for off in offsets:
                os.posix_fadvise(self.fd, off, self.row_bytes, os.POSIX_FADV_WILLNEED)
        out = np.empty((len(uniq), *e.shape[1:]), dtype=self.dtype)
        for j, off in enumerate(offsets):
            try:
                n = os.preadv(self.fd, [out[j]], off)
            except OSError as err:
                raise ReadError(
                    f"{e.path}: {err.strerror} reading '{e.name}' row {int(uniq[j])}; check the disk"
                ) from None
            if n != self.row_bytes:
                raise ShortReadError(f"{e.path}: short read of '{e.name}' row {int(uniq[j])}; the file is truncated")
        if self.after_read is not None:
            self.after_read(e.path)
        rows = bf16_to_f32(out) if e.dtype == "BF16" else out.astype(np.float32)
        return rows if len(uniq) == len(ids) and np.array_equal(uniq, ids) else rows[inv.reshape(-1)]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
