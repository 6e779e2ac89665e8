"""DeepSeek-V4.1's Engram tables streamed from disk: the forward pass's `EngramRows`, backed by
a `store.rowcache.RowCache` over the checkpoint's tables.

Owns the mapping from the model (an Engram layer's table: FP8 E4M3 values [rows, head_dim]
and their scales [rows, head_dim / 32], two tensors far apart in one shard) to the cache's
model-agnostic tables, and the dequantisation of what the cache hands back. The tables never
enter RAM: a row is read when its id is known (`prefetch`, before layer 0 for the whole pass)
and kept in the cache's LRU (its size is the planner's Engram line).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Self

import numpy as np

from ..checkpoint.catalog import NP_DTYPE, Catalog
from ..checkpoint.formats import e4m3_to_f32, scale_to_f32
from ..checkpoint.spec_v41 import engram_names
from ..checkpoint.tensors import linear_names
from ..errors import CheckpointError
from ..store.rowcache import RowArray, RowCache, RowStats, RowTable


def engram_tables(cat: Catalog) -> dict[int, RowTable]:
    """Engram layer -> its table as the row cache reads it: each row is the row's values, then
    its scales (both tensors found by name in the catalog, checked for shape and dtype)."""
    e = cat.config.engram
    if e is None:
        return {}
    out = {}
    for layer in e.layer_ids:
        weight, scale = linear_names(engram_names(cat.config, layer)["table"])
        parts = []
        for name in (weight, scale):
            t = cat.entry(name)
            if len(t.shape) != 2 or t.shape[0] != e.table_rows(layer):
                raise CheckpointError(
                    f"{name}: shape {list(t.shape)}, expected {e.table_rows(layer)} rows of 2-D data;"
                    " the checkpoint does not match config.json"
                )
            row_bytes = t.shape[1] * np.dtype(NP_DTYPE[t.dtype]).itemsize
            parts.append(RowArray(t.path, name, t.offset, t.shape[0], row_bytes))
        out[layer] = RowTable(f"Engram table of layer {layer}", tuple(parts))
    return out


class DiskEngramRows:
    """`EngramRows` from disk through a row cache of `capacity` rows shared by every Engram layer.

    `prefetch(layer, ids)` starts the reads of the absent rows (a hint; never counted as a
    request), `rows(layer, ids)` returns them dequantised exactly as the in-memory provider
    does: E4M3 values times their scale, one per 32 columns, (…, head_dim) float32.
    `io`, `pool`, `threads`, `verify`, `warn`: as `RowCache`."""

    def __init__(
        self,
        cat: Catalog,
        capacity: int,
        io: str = "direct",
        pool: Executor | None = None,
        threads: int = 4,
        verify: bool = False,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        tables = engram_tables(cat)
        if not tables:
            raise CheckpointError(f"{cat.root}: config.json names no Engram layers; this is not a V4.1 checkpoint")
        self.layers = tuple(tables)
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        # the values are E4M3 bytes (the catalog's validation checks the dtypes); scales E8M0 bytes or float32
        self._scale_dtype = [
            np.dtype(NP_DTYPE[cat.entry(linear_names(engram_names(cat.config, layer)["table"])[1]).dtype])
            for layer in self.layers
        ]
        self.head_dim = cat.config.engram.head_dim
        self.cache = RowCache(
            list(tables.values()), capacity, io=io, pool=pool, threads=threads, verify=verify, warn=warn
        )

    def _table(self, layer: int) -> int:
        t = self._index.get(layer)
        if t is None:
            raise CheckpointError(f"layer {layer} has no Engram table (Engram layers: {list(self.layers)})")
        return t

    def prefetch(self, layer: int, ids: np.ndarray) -> None:
        self.cache.prefetch(self._table(layer), np.asarray(ids, dtype=np.int64).reshape(-1))

    def rows(self, layer: int, ids: np.ndarray) -> np.ndarray:
        t = self._table(layer)
        ids = np.asarray(ids, dtype=np.int64)
        return self._dequant(t, self.cache.gather(t, ids.reshape(-1))).reshape(ids.shape + (self.head_dim,))

    def rows_chunks(self, layer: int, ids: np.ndarray, chunk: int) -> Iterator[np.ndarray]:
        """`rows(layer, ids)` in pieces of `chunk` tokens (ids (T, columns)): one gather of the row
        bytes for all T (a row repeated anywhere in them is read and counted once, as in one
        `rows` call, whatever the cache's size), dequantised one piece at a time so the float32
        rows never exist for all T at once (a prefill segment's: S x columns x head_dim)."""
        t = self._table(layer)
        ids = np.asarray(ids, dtype=np.int64)
        raw = self.cache.gather(t, ids.reshape(-1)).reshape(ids.shape[0], -1)
        for a in range(0, ids.shape[0], chunk):
            part = raw[a : a + chunk].reshape(-1, self.cache.tables[t].row_bytes)
            yield self._dequant(t, part).reshape(ids[a : a + chunk].shape + (self.head_dim,))

    def _dequant(self, t: int, raw: np.ndarray) -> np.ndarray:
        """Row bytes (n, values + scales) -> (n, head_dim) float32: E4M3 values times their scale."""
        vb = self.cache.tables[t].parts[0].row_bytes
        vals = e4m3_to_f32(raw[:, :vb])
        s = scale_to_f32(np.ascontiguousarray(raw[:, vb:]).view(self._scale_dtype[t]))
        n, hd = vals.shape
        return (vals.reshape(n, s.shape[1], hd // s.shape[1]) * s[:, :, None]).reshape(n, hd)

    def stats(self) -> RowStats:
        return self.cache.stats()

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def close(self) -> None:
        self.cache.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
