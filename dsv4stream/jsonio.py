"""The one way dsv4stream reads a JSON document from a file or from bytes it holds.

Owns: the size limit (checked on the file's stat before a byte is read, and on bytes), the
depth limit (orjson refuses past 1024 levels itself; `max_depth` is checked on the parsed value
without recursion), the refusal of anything but a regular file (a FIFO would block the read),
and the one-line error. Numbers that JSON cannot hold in a float64 or int64, NaN and Infinity
are not JSON and are refused by the parser. A leaf module: it imports nothing of the project
but `errors`, so every layer can use it.

Callers pass the error class their layer reports (`ConfigError` for config.json,
`CheckpointError` for the index and shard headers, ...) and say what the document is, so the
message names the file, what is wrong and what to do.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import orjson

from .errors import Dsv4Error

MiB = 1 << 20
# Sizes of the documents we read, with room: the largest released one is V4.1's index (7.5 MB).
CONFIG_MAX = 1 * MiB
INDEX_MAX = 64 * MiB
MANIFEST_MAX = 64 * MiB
HEADER_MAX = 100 * MiB  # a safetensors header (the shard's own limit)
DEFAULT_MAX = 16 * MiB
# The deepest released document (tokenizer.json's normalizer sequences) nests fewer than 10 levels.
DEFAULT_DEPTH = 64


def read_json(
    path: str | os.PathLike,
    what: str,
    error: type[Dsv4Error] = Dsv4Error,
    max_bytes: int = DEFAULT_MAX,
    max_depth: int = DEFAULT_DEPTH,
    fix: str = "replace it with a valid copy",
) -> Any:
    """The parsed JSON document at `path`; `what` names it in errors ("config.json", "the index")."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise error(f"{p}: {what} not found") from None
    except OSError as e:
        raise error(f"{p}: cannot read {what} ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{p}: {what} is {_file_kind(st.st_mode)}, not a regular file; {fix}")
    if st.st_size > max_bytes:
        raise error(f"{p}: {what} is {st.st_size:,} bytes, more than the {max_bytes:,} it can be; {fix}")
    try:
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{p}: cannot read {what} ({e.strerror})") from None
    return parse_json(data, f"{p}: {what}", error, max_bytes, max_depth, fix)


def parse_json(
    data: bytes | bytearray | memoryview | str,
    what: str,
    error: type[Dsv4Error] = Dsv4Error,
    max_bytes: int = DEFAULT_MAX,
    max_depth: int = DEFAULT_DEPTH,
    fix: str = "replace it with a valid copy",
) -> Any:
    """The parsed JSON document in `data`; `what` starts the error line ("PATH: the index")."""
    if len(data) > max_bytes:
        raise error(f"{what} is {len(data):,} bytes, more than the {max_bytes:,} it can be; {fix}")
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise error(f"{what} is not valid JSON ({_one_line(str(e))}); {fix}") from None
    depth = nesting_depth(value, max_depth)
    if depth > max_depth:
        raise error(f"{what} nests deeper than {max_depth} levels; {fix}")
    return value


def nesting_depth(value: Any, limit: int) -> int:
    """Levels of arrays/objects in `value` (a scalar is 0), counted without recursion and
    stopping as soon as `limit` is passed (the result is then limit + 1)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            items = v.values()
        elif isinstance(v, list):
            items = v
        else:
            continue
        d += 1
        if d > limit:
            return d
        deepest = max(deepest, d)
        stack.extend((x, d) for x in items if isinstance(x, (dict, list)))
    return deepest


def dumps(value: Any) -> bytes:
    """Compact JSON bytes (the writer's counterpart; keys in the order given)."""
    return orjson.dumps(value)


def _file_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a plain file"


def _one_line(s: str) -> str:
    return " ".join(s.split())
