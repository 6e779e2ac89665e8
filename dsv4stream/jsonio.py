"""The one way dsv4stream reads a JSON document from a file or from bytes it holds.

Owns: the size limit (checked on the open file before a byte is read, and on bytes), the
depth limit (orjson refuses past 1024 levels itself; `max_depth` is checked on the parsed value
without recursion) and the one-line error. Reading goes through `files.read_regular`, which
refuses anything but a regular file without ever blocking on a FIFO. NaN, Infinity and numbers
past a float64 are not JSON and are refused by the parser. A leaf module: it imports nothing of
the project but the other leaves (`errors`, `files`), so every layer can use it.

Callers pass the error class their layer reports (`ConfigError` for config.json,
`CheckpointError` for the index and shard headers, ...) and say what the document is, so the
message names the file, what is wrong and what to do.
"""

from __future__ import annotations

import os
import re
from typing import Any

import orjson

from .errors import Dsv4Error
from .files import read_regular

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
    data = read_regular(path, what, error, limit=max_bytes)
    return parse_json(data, f"{path}: {what}", error, max_bytes, max_depth, fix)


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
        raise error(f"{what} is not valid JSON{_where(data, e.pos)} ({_one_line(str(e))}); {fix}") from None
    depth = nesting_depth(value, max_depth)
    if depth > max_depth:
        raise error(f"{what} nests deeper than {max_depth} levels; {fix}")
    return value


def _where(data: bytes | bytearray | memoryview | str, pos: int) -> str:
    """` at "key"` when the parser stopped on an object member's value (a NaN or Infinity written
    by a non-JSON encoder is the common case), so the line names the field to fix."""
    text = (
        bytes(data[max(0, pos - 200) : pos]).decode("utf-8", "replace")
        if not isinstance(data, str)
        else data[max(0, pos - 200) : pos]
    )
    m = re.search(r'"([^"\\]{1,80})"\s*:\s*-?$', text)
    return f' at "{m.group(1)}"' if m else ""


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


def _one_line(s: str) -> str:
    return " ".join(s.split())
