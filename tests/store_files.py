"""Temp files laid out like the release's expert tensors, for the store tests.

Each file starts with an odd-sized header (so nothing is 4096-aligned), then every
expert's three scale tensors back to back, then filler "hundreds of pages" long, then
every expert's three weight tensors back to back: two runs per expert, far apart, at
unaligned offsets. Shapes are FP4-like (I=64, D=96): weights 3072 bytes, scales 192.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dsv4stream.store.runs import Piece, merge_pieces

D, INTER = 96, 64
SHAPES = {
    "w1.weight": (INTER, D // 2),
    "w1.scale": (INTER, D // 32),
    "w2.weight": (D, INTER // 2),
    "w2.scale": (D, INTER // 32),
    "w3.weight": (INTER, D // 2),
    "w3.scale": (INTER, D // 32),
}


def _nbytes(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape))


def make_files(
    root: Path, layers: int = 3, experts: int = 8, files: int = 2, header: int = 1237, gap: int = 300_003, seed: int = 0
):
    """Write the files; return (layouts {(L, E): Layout}, truth {tensor name: bytes})."""
    rng = np.random.default_rng(seed)
    keys = [(la, e) for la in range(layers) for e in range(experts)]
    located: dict[tuple[int, int], list] = {k: [] for k in keys}
    truth: dict[str, bytes] = {}
    for f in range(files):
        path = root / f"shard-{f}.bin"
        mine = keys[f::files]
        blob = bytearray(rng.integers(0, 256, header, dtype=np.uint8).tobytes())
        for kind in ("scale", "weight"):
            for key in mine:
                for t in ("w1", "w2", "w3"):
                    tname = f"{t}.{kind}"
                    name = f"layers.{key[0]}.ffn.experts.{key[1]}.{tname}"
                    data = rng.integers(0, 256, _nbytes(SHAPES[tname]), dtype=np.uint8).tobytes()
                    piece = Piece(name, len(blob), len(data), np.dtype(np.uint8), SHAPES[tname])
                    located[key].append((str(path), piece))
                    truth[name] = data
                    blob += data
            if kind == "scale":
                blob += rng.integers(0, 256, gap, dtype=np.uint8).tobytes()
        path.write_bytes(bytes(blob))
    layouts = {k: merge_pieces(v) for k, v in located.items()}
    return layouts, truth


def expected(layout) -> list[bytes]:
    """The bytes each piece must hold, read with plain Python file I/O (layout order)."""
    out = []
    for run in layout:
        with open(run.path, "rb") as f:
            for p in run.pieces:
                f.seek(p.offset)
                out.append(f.read(p.nbytes))
    return out
