"""Byte layout of a stored item: pieces (tensors) and runs (contiguous bytes in one file).

Owns the model-agnostic data model of the expert store and the merge of pieces into runs.
It knows nothing of alignment, slots or the model: an item is whatever the caller groups
under one key, and its layout is ``tuple[Run, ...]``.

Layout order: the arrays ``ExpertStore.get`` returns follow ``layout_pieces(layout)``,
i.e. run by run, and inside a run the order of ``Run.pieces``. ``merge_pieces`` emits runs
in (path, offset) order and pieces in offset order, so that order is file order; a caller
that wants its own order keeps a permutation (see ``layout.ExpertLayouts``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..errors import CheckpointError, InternalError


@dataclass(frozen=True)
class Piece:
    """One array stored at ``offset`` (absolute, bytes) of its file: ``nbytes`` of ``dtype``."""

    name: str
    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        dtype = np.dtype(self.dtype)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        count = 1
        for d in self.shape:
            count *= d
        if self.offset < 0 or count * dtype.itemsize != self.nbytes:
            raise InternalError(
                f"piece {self.name}: offset {self.offset}, shape {self.shape} of {dtype} "
                f"needs {count * dtype.itemsize} bytes, layout says {self.nbytes}"
            )


@dataclass(frozen=True)
class Run:
    """``nbytes`` contiguous bytes of ``path`` from ``offset``, holding ``pieces``."""

    path: str
    offset: int
    nbytes: int
    pieces: tuple[Piece, ...]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


Layout = tuple[Run, ...]


def merge_pieces(located: Iterable[tuple[str, Piece]], max_gap: int = 0) -> Layout:
    """Merge ``(path, piece)`` pairs into the fewest runs; a gap of up to ``max_gap``
    bytes between neighbours is read along rather than split (0: only touching pieces).

    Runs come out in (path, offset) order. Overlapping pieces are refused: two tensors
    never share bytes in a safetensors file, so an overlap means a corrupt catalog.
    """
    items = sorted(located, key=lambda pp: (pp[0], pp[1].offset, pp[1].nbytes))
    runs: list[Run] = []
    for path, piece in items:
        last = runs[-1] if runs else None
        if last is not None and last.path == path:
            if piece.offset < last.end:
                prev = last.pieces[-1].name
                raise CheckpointError(f"{path}: tensors {prev} and {piece.name} overlap; the shard header is corrupt")
            if piece.offset - last.end <= max_gap:
                end = piece.offset + piece.nbytes
                runs[-1] = Run(path, last.offset, end - last.offset, last.pieces + (piece,))
                continue
        runs.append(Run(path, piece.offset, piece.nbytes, (piece,)))
    return tuple(runs)


def layout_pieces(layout: Layout) -> tuple[Piece, ...]:
    """The pieces of ``layout`` in layout order (the order ``get`` returns arrays in)."""
    return tuple(p for run in layout for p in run.pieces)


def layout_nbytes(layout: Layout) -> int:
    """Bytes of the pieces themselves (what the item holds, not what a read fetches)."""
    return sum(p.nbytes for run in layout for p in run.pieces)
