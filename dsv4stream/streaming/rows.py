"""Embedding rows read on demand with pread: only the rows of the tokens asked for."""

from __future__ import annotations

import os

import numpy as np

from ..catalog import NP_DTYPE, TensorEntry
from ..errors import CheckpointError, ReadError, ShortReadError
from ..formats import bf16_to_f32


class RowReader:
    """Rows of a 2-D tensor (the embedding) read on demand with pread: (T,) ids -> (T, D) float32."""

    def __init__(self, e: TensorEntry) -> None:
        self.e = e
        self.dtype = np.dtype(NP_DTYPE[e.dtype])
        self.row_bytes = int(np.prod(e.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self.fd = os.open(e.path, os.O_RDONLY)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        e = self.e
        out = np.empty((len(ids), *e.shape[1:]), dtype=self.dtype)
        for j, r in enumerate(ids):
            if not 0 <= r < e.shape[0]:
                raise CheckpointError(f"'{e.name}': row {r} outside 0..{e.shape[0] - 1}")
            try:
                b = os.pread(self.fd, self.row_bytes, e.offset + int(r) * self.row_bytes)
            except OSError as err:
                raise ReadError(f"{e.path}: {err.strerror} reading '{e.name}' row {r}; check the disk") from None
            if len(b) != self.row_bytes:
                raise ShortReadError(f"{e.path}: short read of '{e.name}' row {r}; the file is truncated")
            out[j] = np.frombuffer(b, dtype=self.dtype).reshape(e.shape[1:])
        return bf16_to_f32(out) if e.dtype == "BF16" else out.astype(np.float32)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
