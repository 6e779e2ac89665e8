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
identity and the layout, then every field against a fresh session's state (a file whose
checksum was recomputed after an edit must not reach the forward pass): each class with a
`check_restored(fresh, pos)` says what else holds for its fields after `pos` tokens: every
counter a class keeps (rows emitted, open-window rows, ring positions) is tied to `pos` by the
facts its fresh copy carries (ratio, window, keyed), so no counter can drift by one; and what
a state derives from the token ids themselves (V4.1's Engram history) is checked against the
header's ids by the engine's `Stack.agrees`.
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


# (the layers of a decoded state, its token ids) -> what is wrong between them, or None
Agrees = Callable[[list[Any], list[int]], str | None]

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


def from_bytes(
    blob: bytes, identity: str, template: Sequence[Any], agrees: Agrees | None = None
) -> tuple[SessionState, list[int]]:
    """(state, token ids) of a file; StateFileError when it is not one this session may use.

    The checksum proves only that the file was not damaged, not that its writer was this
    code: every field is checked against `template` (a fresh session's state, so this
    checkpoint's shapes) and the header's own counters before anything is allocated, then
    against the token ids by `agrees` (the engine's `Stack.agrees`: what the state derives
    from the ids themselves, V4.1's Engram history)."""
    header = read_header(blob)
    if header.get("identity") != identity:
        raise StateFileError(f"written for another checkpoint (identity {str(header.get('identity'))[:16]}...)")
    if header.get("layout") != layout_hash(template):
        raise StateFileError("written for another state layout (another dsv4stream version)")
    try:
        ids, pos = header["ids"], header["pos"]
        if type(pos) is not int or not isinstance(ids, list) or len(ids) != pos or pos < 1:
            raise ValueError(f"position {pos!r} with {len(ids) if isinstance(ids, list) else '?'} token ids")
        if not all(type(i) is int and 0 <= i < 1 << 31 for i in ids):
            raise ValueError("token ids that are not ids")
        arrays = _views(blob, header["arrays"], header["_payload"], len(blob) - _DIGEST)
        used: set[int] = set()
        layers = _decode(header["tree"], arrays, list(template), _Check(pos, used), "state")
        if len(used) != len(arrays):
            raise ValueError(f"{len(arrays) - len(used)} array(s) no field refers to")
        problem = agrees(layers, ids) if agrees is not None else None
        if problem:
            raise ValueError(problem)
    except (KeyError, TypeError, ValueError, IndexError, RecursionError) as e:
        raise StateFileError(f"malformed header ({type(e).__name__}: {e})") from None
    return capture(pos, layers), ids


def _views(blob: bytes, table: Any, base: int, end: int) -> list[np.ndarray]:
    """The arrays of the table as read-only views into `blob` (nothing copied): plain numeric
    dtypes, shapes of non-negative ints, laid out back to back from the payload's start."""
    if not isinstance(table, list):
        raise TypeError("the array table is not a list")
    arrays, offset = [], 0
    for entry in table:
        dtype, shape, at = entry
        dt = np.dtype(dtype)
        if dt.kind not in "biuf" or dt.fields is not None or dt.subdtype is not None:
            raise ValueError(f"dtype {dtype!r} is not a plain number")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"shape {shape!r}")
        if at != offset:
            raise ValueError(f"array at offset {at!r}, expected {offset} (back to back)")
        count = int(np.prod(shape, dtype=np.int64))
        offset += count * dt.itemsize
        if base + offset > end:
            raise ValueError("array table points past the payload")
        arrays.append(np.frombuffer(blob, dt, count, base + at).reshape(shape))
    return arrays


@dataclass(frozen=True)
class _Check:
    pos: int  # tokens the state has read (the header's, already checked against its ids)
    used: set[int]  # arrays referred to so far: each at most once


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


def _decode(node: Any, arrays: list[np.ndarray], like: Any, check: _Check, where: str) -> Any:
    """The file's `node`, checked against `like` (the same place in a fresh session's state):
    the same classes, fields and list lengths, scalars of the same type, arrays of the same
    dtype and rank whose axes past the first match (the first may have grown: rows emitted so
    far), and each object's own `check_restored(fresh, pos)` for what only it knows."""
    if isinstance(like, np.ndarray) or like is None:
        if node is None and like is None:
            return None
        if not isinstance(node, dict) or set(node) != {"a"} or type(node["a"]) is not int:
            raise ValueError(f"{where}: expected an array")
        i = node["a"]
        if not 0 <= i < len(arrays) or i in check.used:
            raise ValueError(f"{where}: array {i} is not in the table or referred to twice")
        check.used.add(i)
        a = arrays[i]
        if like is None:
            if a.dtype != np.float32 or a.ndim != 2 or a.shape[0] > check.pos:
                raise ValueError(f"{where}: a {a.dtype} array of shape {a.shape} where open rows belong")
        elif a.dtype != like.dtype or a.shape[1:] != like.shape[1:] or a.ndim != like.ndim:
            raise ValueError(f"{where}: {a.dtype} {a.shape}, expected {like.dtype} (*, {like.shape[1:]})")
        return a
    if isinstance(like, (np.generic, *_SCALARS)):
        want = type(like.item()) if isinstance(like, np.generic) else type(like)
        if type(node) is not want or (want is float and not np.isfinite(node)):
            raise ValueError(f"{where}: {node!r}, expected a {want.__name__}")
        return node
    if isinstance(like, list | tuple):
        if not isinstance(node, dict) or set(node) != {"l"} or not isinstance(node["l"], list):
            raise ValueError(f"{where}: expected a list")
        items = node["l"]
        if like:  # a fixed structure (layers, groups): the same length
            if len(items) != len(like):
                raise ValueError(f"{where}: {len(items)} items, expected {len(like)}")
            out = [_decode(c, arrays, k, check, f"{where}[{j}]") for j, (c, k) in enumerate(zip(items, like))]
        else:  # empty when fresh (a history of ids): ids, at most one per token read
            if len(items) > check.pos or not all(type(c) is int and -1 <= c < 1 << 31 for c in items):
                raise ValueError(f"{where}: a list of {len(items)} that is not a history of ids")
            out = list(items)
        return tuple(out) if isinstance(like, tuple) else out
    cls, fields = type(like), _fields(like)
    if not isinstance(node, dict) or set(node) != {"o", "f"} or node["o"] != cls.__qualname__:
        raise ValueError(f"{where}: expected a {cls.__qualname__}")
    if not isinstance(node["f"], dict) or set(node["f"]) != set(fields):
        raise ValueError(f"{where}: fields differ from a {cls.__qualname__}'s")
    obj = cls.__new__(cls)
    vars(obj).update({k: _decode(v, arrays, fields[k], check, f"{where}.{k}") for k, v in node["f"].items()})
    problem = obj.check_restored(like, check.pos) if hasattr(obj, "check_restored") else None
    if problem:
        raise ValueError(f"{where}: {problem}")
    return obj
