"""Temp files laid out like the release's expert tensors, for the store tests.

Each file starts with an odd-sized header (so nothing is 4096-aligned), then every
expert's three scale tensors back to back, then filler "hundreds of pages" long, then
every expert's three weight tensors back to back: two runs per expert, far apart, at
unaligned offsets. Shapes are FP4-like (I=64, D=96): weights 3072 bytes, scales 192.
"""

from __future__ import annotations

import json
import struct
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
    """Write the files (real safetensors: the verifier finds tensors through their headers);
    return (layouts {(L, E): Layout}, truth {tensor name: bytes})."""
    rng = np.random.default_rng(seed)
    keys = [(la, e) for la in range(layers) for e in range(experts)]
    located: dict[tuple[int, int], list] = {k: [] for k in keys}
    truth: dict[str, bytes] = {}
    for f in range(files):
        path = root / f"shard-{f}.safetensors"
        mine = keys[f::files]
        tensors: list[tuple[str, tuple[int, ...], bytes]] = []
        for kind in ("scale", "weight"):
            for key in mine:
                for t in ("w1", "w2", "w3"):
                    tname = f"{t}.{kind}"
                    name = f"layers.{key[0]}.ffn.experts.{key[1]}.{tname}"
                    data = rng.integers(0, 256, _nbytes(SHAPES[tname]), dtype=np.uint8).tobytes()
                    tensors.append((name, SHAPES[tname], data))
            if kind == "scale":
                tensors.append((f"filler.{f}", (gap,), rng.integers(0, 256, gap, dtype=np.uint8).tobytes()))
        meta, pos = {}, 0
        for name, shape, data in tensors:
            meta[name] = {"dtype": "U8", "shape": list(shape), "data_offsets": [pos, pos + len(data)]}
            pos += len(data)
        h = json.dumps(meta).encode()
        # pad the header so the data starts at an odd offset (`header` mod 4096): nothing aligned
        h += b" " * ((header - 8 - len(h)) % 4096)
        base = 8 + len(h)
        for name, shape, data in tensors:
            if name.startswith("layers."):
                piece = Piece(name, base + meta[name]["data_offsets"][0], len(data), np.dtype(np.uint8), shape)
                key = tuple(int(x) for x in name.split(".")[1:5:3])
                located[key].append((str(path), piece))
                truth[name] = data
        path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(d for _, _, d in tensors))
    layouts = {k: merge_pieces(v) for k, v in located.items()}
    return layouts, truth


def o_direct_refusal(directory: Path) -> str | None:
    """Why O_DIRECT does not work in ``directory`` (None: it does), probed the way the store
    reads, independently of ``directio``: an O_DIRECT open and one 4096-byte aligned read."""
    import mmap
    import os

    probe = Path(directory) / f".o_direct_probe_{os.getpid()}"
    probe.write_bytes(bytes(range(256)) * 32)  # 8192 bytes
    try:
        try:
            fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            return f"the file system of {directory} refuses O_DIRECT on open ({e.strerror})"
        try:
            buf = mmap.mmap(-1, 4096)  # page-aligned
            try:
                n = os.preadv(fd, [buf], 4096)
            except OSError as e:
                return f"the file system of {directory} refuses an aligned O_DIRECT read ({e.strerror})"
            if n != 4096 or buf[:256] != bytes(range(256)):
                return f"an aligned O_DIRECT read in {directory} returned wrong bytes"
        finally:
            os.close(fd)
    finally:
        probe.unlink()
    return None


def make_row_files(root: Path, rows: tuple[int, ...] = (3001, 1999), width: int = 256, scales: int = 8, seed: int = 0):
    """Tables laid out like V4.1's Engram: per table one safetensors file holding the rows
    ([rows, width] bytes), a filler, then the rows' scales ([rows, scales] bytes) far after
    them; nothing 4096-aligned. Returns [(path, values name, scales name)] (written by the
    safetensors library, which the tests also read them back with)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    out = []
    for t, n in enumerate(rows):
        path = root / f"table-{t}.safetensors"
        names = (f"t{t}.a.values", f"t{t}.c.scales")
        save_file(
            {
                names[0]: rng.integers(0, 256, (n, width), dtype=np.uint8),
                f"t{t}.b.filler": rng.integers(0, 256, 300_003 + 1000 * t, dtype=np.uint8),
                names[1]: rng.integers(0, 256, (n, scales), dtype=np.uint8),
            },
            str(path),
            metadata={"pad": "x" * (37 + 11 * t)},
        )
        out.append((path, *names))
    return out
