"""The per-sequence caches both families keep: the sliding window's ring of key/value rows and
the growing buffer of compressed rows.

Owns: the storage and its growth rule, nothing of the math that fills them (`v4.attention`,
`v4.compressor`, `v41.attention`, `v41.kv`). `run.planner` counts the buffers' bytes with
`row_capacity`.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


class WindowCache:
    """The last `size` (key=value) rows with their positions; a ring, never the full history."""

    def __init__(self, size: int, d: int) -> None:
        self.kv = np.zeros((size, d), dtype=F32)
        self.pos = np.full(size, -1, dtype=np.int64)

    def with_new(self, kv: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Cached rows in position order followed by the chunk's rows: keys (S, d), positions (S,).

        Position order, not the ring's slot order: attention adds a query's visible rows in the
        order they come (`kernels.attn`), so a query of a k-token pass must meet its window in
        the order a one-token step at its position meets it (the step's ring holds the pass's
        earlier rows in slots before the older ones once the ring has wrapped), or its row
        differs from the step's in the last bits; then official numerics' grids can round the
        two apart and a verification pass picks other greedy ids than plain decoding."""
        held = self._held()
        return np.concatenate([self.kv[held], kv]), np.concatenate([self.pos[held], positions])

    def _held(self) -> np.ndarray:
        """The ring's filled slots in position order."""
        held = np.flatnonzero(self.pos >= 0)
        return held[np.argsort(self.pos[held], kind="stable")]

    def ordered(self, kv: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`with_new`'s keys and positions, the keys written into this thread's buffer
        (`kernels.trunkops.rows_buffer`) instead of two new arrays: valid until the thread's next
        `ordered` call of that width (attention reads them at once).

        At one token `with_new` took 0.1-0.25 ms a layer (V4-Flash, 128 x 512 rows): the gathered
        rows and their copy are each above glibc's mmap threshold, so every step mapped fresh pages
        and faulted them in; the buffer is mapped once."""
        if kv.dtype != F32:
            return self.with_new(kv, positions)
        held = self._held()
        from ..kernels.trunkops import rows_buffer  # numba's module: imported when a pass computes

        n, t, d = held.size, kv.shape[0], self.kv.shape[1]
        keys = rows_buffer(n + t, d)
        # in position order the ring's slots are one or two runs (two once it has wrapped): copy runs
        ends = [*(np.flatnonzero(np.diff(held) != 1) + 1).tolist(), n] if n else []
        if len(ends) <= 4:
            a = 0
            for b in ends:
                keys[a:b] = self.kv[held[a] : held[b - 1] + 1]
                a = b
        else:
            np.take(self.kv, held, axis=0, out=keys[:n])
        keys[n:] = kv
        return keys, np.concatenate([self.pos[held], positions])

    def push(self, kv: np.ndarray, positions: np.ndarray) -> None:
        size = self.pos.shape[0]
        kv, positions = kv[-size:], positions[-size:]
        slots = positions % size
        self.kv[slots] = kv
        self.pos[slots] = positions

    def check_restored(self, fresh: WindowCache, pos: int) -> str | None:
        """What is wrong with this ring, read from a state file, after `pos` tokens (None: fine):
        its shapes are the fresh ring's, and it holds exactly the last min(pos, size) positions,
        each at its slot, the other slots -1."""
        if self.kv.shape != fresh.kv.shape or self.pos.shape != fresh.pos.shape:
            return f"a window of {self.kv.shape}, expected {fresh.kv.shape}"
        size = self.pos.shape[0]
        want = np.full(size, -1, dtype=np.int64)
        last = np.arange(max(0, pos - size), pos)
        want[last % size] = last
        if not np.array_equal(self.pos, want):
            return f"window positions that {pos} tokens cannot have left"
        return None


# A full RowBuffer grows by 1/ROW_SLACK of its rows: at most 12.5% unused (doubling left up to
# half of a long context's compressed rows allocated and unused); `planner.state_bytes_for`
# counts `row_capacity`.
ROW_SLACK = 8


def row_capacity(n: int) -> int:
    """The most rows a RowBuffer holding n rows has allocated."""
    return max(16, n + n // ROW_SLACK)


class RowBuffer:
    """Append-only (n, d) float32 rows with amortised growth (capacity <= row_capacity(n))."""

    def __init__(self, d: int) -> None:
        self._a = np.zeros((16, d), dtype=F32)
        self.n = 0

    def extend(self, rows: np.ndarray) -> None:
        need = self.n + rows.shape[0]
        if need > self._a.shape[0]:
            cap = self._a.shape[0]
            grown = np.zeros((max(need, cap + cap // ROW_SLACK), self._a.shape[1]), dtype=F32)
            grown[: self.n] = self._a[: self.n]
            self._a = grown
        self._a[self.n : need] = rows
        self.n = need

    @property
    def rows(self) -> np.ndarray:
        return self._a[: self.n]

    def check_restored(self, fresh: RowBuffer, pos: int) -> str | None:
        """What is wrong with this buffer, read from a state file, after `pos` tokens (None: fine)."""
        if not 0 <= self.n <= min(pos, self._a.shape[0]) or self._a.shape[0] > row_capacity(pos):
            return f"{self.n} rows in a buffer of {self._a.shape[0]} after {pos} tokens"
        return None
