"""A session's state as a value: snapshot, restore, and a checked file format.

Owns: `SessionState` (an immutable copy of everything a `Session` carries between forward
passes: its position and each layer's window ring, compressed rows and open compressor
windows), `capture` / `apply` behind `Session.snapshot()` / `Session.restore()`, and the
bytes of a state on disk (`to_bytes` / `from_bytes`). Not here: which states to keep and
where (`server/cache.py`).

Why a restored state gives the same logits bit for bit: the copy is exact (every array
copied, nothing recomputed), and the forward pass reads nothing else of the session.

The state is walked generically (objects' fields, lists, arrays, plain scalars), so the
layout of `model.v4.attention` / `model.v4.compressor` may change without touching this file;
a file written for another layout is refused (its skeleton hash differs).

File layout: MAGIC (8 bytes), header length (8 bytes, little-endian), the header (UTF-8
JSON: format version, checkpoint identity, layout hash, token ids, position, the object
tree with arrays replaced by references), the arrays' bytes back to back, then the SHA-256
of everything before it (32 bytes). Loading rebuilds objects only of the classes found in a
fresh session's state (never arbitrary code), after checking the length, the hash, the
identity and the layout.
"""

from __future__ import annotations

import copy
import hashlib
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import jsonio
from ..errors import Dsv4Error

MAGIC = b"DSV4STAT"
VERSION = 1
_DIGEST = 32


class StateFileError(Dsv4Error):
    """A state file that must not be used: truncated, corrupt, or of another checkpoint/layout."""


@dataclass(frozen=True)
class SessionState:
    """A session after `pos` tokens; its arrays are read-only copies (restore copies again)."""

    pos: int
    layers: tuple[Any, ...]  # per layer, the session's own state objects (deep copies)
    nbytes: int  # bytes of the arrays held


def capture(pos: int, layers: Sequence[Any]) -> SessionState:
    held = tuple(copy.deepcopy(list(layers)))
    total = 0
    for a in _arrays(held):
        a.flags.writeable = False
        total += a.nbytes
    return SessionState(pos, held, total)


def thaw(state: SessionState) -> list[Any]:
    """Writable copies of the layers, for a session to continue from."""
    layers = copy.deepcopy(list(state.layers))
    for a in _arrays(layers):
        a.flags.writeable = True  # deepcopy of a read-only array is writable already; kept explicit
    return layers


def layout_hash(template: Sequence[Any]) -> str:
    """Hash of the state's shape of objects (class and field names, recursively); arrays and
    None count as the same leaf, as an open window is None until it holds tokens."""
    return hashlib.sha256(_skeleton(list(template)).encode()).hexdigest()[:16]


def to_bytes(state: SessionState, ids: Sequence[int], identity: str, template: Sequence[Any]) -> bytes:
    """The file bytes of `state`, which has read `ids` (`len(ids) == state.pos`)."""
    if len(ids) != state.pos:
        raise ValueError(f"state at position {state.pos} with {len(ids)} token ids")
    arrays: list[np.ndarray] = []
    tree = _encode(list(state.layers), arrays)
    table, offset = [], 0
    for a in arrays:
        table.append([a.dtype.str, list(a.shape), offset])
        offset += a.nbytes
    header = {
        "version": VERSION,
        "identity": identity,
        "layout": layout_hash(template),
        "pos": state.pos,
        "ids": [int(i) for i in ids],
        "arrays": table,
        "tree": tree,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join([MAGIC, struct.pack("<Q", len(head)), head, *(np.ascontiguousarray(a).tobytes() for a in arrays)])
    return body + hashlib.sha256(body).digest()


def read_header(blob: bytes) -> dict[str, Any]:
    """The header of a state file, after checking magic, length and the trailing hash."""
    if len(blob) < len(MAGIC) + 8 + _DIGEST or blob[: len(MAGIC)] != MAGIC:
        raise StateFileError("not a dsv4 state file (bad magic or too short)")
    body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise StateFileError("checksum mismatch (truncated or corrupt)")
    (n,) = struct.unpack("<Q", blob[len(MAGIC) : len(MAGIC) + 8])
    try:
        header = jsonio.parse_json(body[len(MAGIC) + 8 : len(MAGIC) + 8 + n], "header")
    except Dsv4Error as e:
        raise StateFileError(f"unreadable header ({e})") from None
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise StateFileError(f"state format version {header.get('version') if isinstance(header, dict) else '?'}")
    header["_payload"] = len(MAGIC) + 8 + n
    return header


HEADER_LIMIT = 64 << 20  # bytes of a file's JSON header: token ids and the object tree, never near this


def peek(read: Callable[[int, int], bytes], size: int) -> dict[str, Any]:
    """The header of a state file of `size` bytes, read through `read(offset, n)` before the
    payload: magic, header length, version, and that the array table accounts for exactly the
    file's size. A bogus or foreign file is refused after reading at most its header, never
    read whole (the caller then reads it all, and `from_bytes` checks the trailing hash)."""
    lead = len(MAGIC) + 8
    if size < lead + _DIGEST:
        raise StateFileError("not a dsv4 state file (too short)")
    first = read(0, lead)
    if first[: len(MAGIC)] != MAGIC:
        raise StateFileError("not a dsv4 state file (bad magic)")
    (n,) = struct.unpack("<Q", first[len(MAGIC) :])
    if n > HEADER_LIMIT or lead + n + _DIGEST > size:
        raise StateFileError(f"header length {n} does not fit the file's {size} bytes")
    try:
        header = json.loads(read(lead, n))
        if not isinstance(header, dict) or header.get("version") != VERSION:
            raise StateFileError("state format version differs")
        payload = sum(
            int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for dtype, shape, _ in header["arrays"]
        )
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise StateFileError(f"unreadable header ({type(e).__name__})") from None
    if lead + n + payload + _DIGEST != size:
        raise StateFileError(f"{size} bytes, its header describes {lead + n + payload + _DIGEST}")
    return header


def from_bytes(blob: bytes, identity: str, template: Sequence[Any]) -> tuple[SessionState, list[int]]:
    """(state, token ids) of a file; StateFileError when it is not one this session may use."""
    header = read_header(blob)
    if header.get("identity") != identity:
        raise StateFileError(f"written for another checkpoint (identity {str(header.get('identity'))[:16]}...)")
    if header.get("layout") != layout_hash(template):
        raise StateFileError("written for another state layout (another dsv4stream version)")
    base, end = header["_payload"], len(blob) - _DIGEST
    arrays = []
    try:
        for dtype, shape, offset in header["arrays"]:
            dt = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            start = base + offset
            if start + count * dt.itemsize > end:
                raise StateFileError("array table points past the payload")
            arrays.append(np.frombuffer(blob, dt, count, start).reshape(shape))
        classes = {type(o).__qualname__: type(o) for o in _objects(list(template))}
        layers = _decode(header["tree"], arrays, classes)
        ids, pos = [int(i) for i in header["ids"]], int(header["pos"])
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise StateFileError(f"malformed header ({type(e).__name__}: {e})") from None
    if not isinstance(layers, list) or len(layers) != len(template) or len(ids) != pos:
        raise StateFileError("header does not describe this model's layers")
    return capture(pos, layers), ids


# ---- the walk -------------------------------------------------------------------------------

_SCALARS = (bool, int, float, str, type(None))
_LEAVES = (np.ndarray, np.generic, *_SCALARS)


def _fields(obj: Any) -> dict[str, Any]:
    if not hasattr(obj, "__dict__"):
        raise TypeError(f"cannot snapshot a {type(obj).__name__}")
    return vars(obj)


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, _LEAVES):
        return []
    if isinstance(obj, list | tuple):
        return list(obj)
    return list(_fields(obj).values())


def _arrays(obj: Any):
    if isinstance(obj, np.ndarray):
        yield obj
    for c in _children(obj):
        yield from _arrays(c)


def _objects(obj: Any):
    if not isinstance(obj, (*_LEAVES, list, tuple)):
        yield obj
    for c in _children(obj):
        yield from _objects(c)


def _skeleton(obj: Any) -> str:
    if isinstance(obj, np.ndarray | None):
        return "a"
    if isinstance(obj, (np.generic, *_SCALARS)):
        return type(obj).__name__
    if isinstance(obj, list | tuple):
        return "[" + ",".join(_skeleton(c) for c in obj) + "]"
    inner = ",".join(f"{k}:{_skeleton(v)}" for k, v in sorted(_fields(obj).items()))
    return f"{type(obj).__qualname__}{{{inner}}}"


def _encode(obj: Any, arrays: list[np.ndarray]) -> Any:
    if isinstance(obj, np.ndarray):
        arrays.append(obj)
        return {"a": len(arrays) - 1}
    if isinstance(obj, np.generic):
        return obj.item()  # a numpy scalar comes back as the Python scalar
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, list | tuple):
        return {"l": [_encode(c, arrays) for c in obj]}
    return {"o": type(obj).__qualname__, "f": {k: _encode(v, arrays) for k, v in _fields(obj).items()}}


def _decode(node: Any, arrays: list[np.ndarray], classes: dict[str, type]) -> Any:
    if not isinstance(node, dict):
        if not isinstance(node, _SCALARS):
            raise TypeError(f"unexpected {type(node).__name__} in the tree")
        return node
    if "a" in node:
        return arrays[node["a"]].copy()
    if "l" in node:
        return [_decode(c, arrays, classes) for c in node["l"]]
    cls = classes.get(node["o"])
    if cls is None:
        raise TypeError(f"class {node['o']!r} is not part of a session's state")
    obj = cls.__new__(cls)
    vars(obj).update({k: _decode(v, arrays, classes) for k, v in node["f"].items()})
    return obj
