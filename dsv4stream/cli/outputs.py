"""The one rule for every file a command writes: never over an input, never half a file.

Owns: `check_output` (refuses, before any work, a path that is not a regular file, whose
folder is missing, or that is a file of a checkpoint, of a trunk pack or its staging
folder, a tokenizer pack, or a kv cache state) and `check_output_dir` (the same for a
folder that will receive several outputs); `refuse_bad_output` is `check_output` for the
bench scripts (one line, exit 2). Writing itself is `files.AtomicFile` /
`files.atomic_write` (temp file in the same folder, then rename), so a run that fails never
truncates the old file or leaves half a new one.

What counts as a checkpoint's file: in a folder that holds `config.json` or the safetensors
index, the config, generation config, index and tokenizer files, every file the index
names, and every `*.safetensors`. Both the path as given and the file a symbolic link
leads to are checked (a checkpoint is often a folder of links into a download cache).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..checkpoint.catalog import INDEX_NAME
from ..errors import UsageError
from ..files import describe, read_regular
from ..server.cache import SUFFIX as STATE_SUFFIX
from ..text.tokenizer import is_pack as is_tokenizer_pack
from ..trunkpack.format import JOURNAL, MANIFEST, TRUNK_FILE
from ..trunkpack.packdir import read_manifest

CHECKPOINT_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        INDEX_NAME,
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
    }
)
INDEX_LIMIT = 64 << 20  # a real index is a few MB


def _index_names(folder: Path) -> set[str]:
    """File names the folder's safetensors index points at (none when it has no readable index)."""
    try:
        wm = json.loads(read_regular(folder / INDEX_NAME, "the index", limit=INDEX_LIMIT)).get("weight_map")
    except Exception:  # noqa: BLE001 (unreadable, not JSON, too deep: then only the fixed names count)
        return set()
    return {str(v) for v in wm.values()} if isinstance(wm, dict) else set()


def _is_checkpoint_folder(folder: Path) -> bool:
    return (folder / "config.json").exists() or (folder / INDEX_NAME).exists()


def protected(path: Path) -> str | None:
    """What `path` belongs to that an output must never replace, in words; None when it is free."""
    folder, name = path.parent, path.name
    if name.endswith(STATE_SUFFIX) or (name.startswith(".") and f"{STATE_SUFFIX}.tmp" in name):
        return f"a state file of a kv cache ({folder})"
    if read_manifest(folder) is not None:
        return f"in the trunk pack {folder}"
    if name in (TRUNK_FILE, JOURNAL, MANIFEST, f"{MANIFEST}.tmp") and (folder / JOURNAL).exists():
        return f"a file of an unfinished trunk pack ({folder})"
    if name.endswith(".safetensors"):
        return "a safetensors file (checkpoint weights)"
    if _is_checkpoint_folder(folder) and (name in CHECKPOINT_FILES or name in _index_names(folder)):
        return f"a file of the checkpoint in {folder}"
    if describe(path) == "a regular file" and is_tokenizer_pack(path):
        return "a dsv4 tokenizer pack"
    return None


def check_output(path: Path | None, flag: str) -> None:
    """Refuse, with one line and before any work, an output path that cannot or must not be written."""
    if path is None:
        return
    path = Path(path)
    kind = describe(path)
    if kind == "a directory":
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    if kind not in (None, "a regular file"):
        raise UsageError(f"{flag} {path}: is {kind}, not a regular file; give a file name")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {path.parent} does not exist; create it first")
    for p in dict.fromkeys((path.absolute(), Path(os.path.realpath(path)))):
        why = protected(p)
        if why is not None:
            raise UsageError(f"{flag} {path}: is {why}; writing there would destroy it — give another file name")


def refuse_bad_output(path: str | os.PathLike | None, flag: str) -> None:
    """`check_output` for a script outside the `dsv4` command (the benches): a refused path
    is one line `dsv4: ...` on stderr and exit status 2, before any work."""
    try:
        check_output(Path(path) if path else None, flag)
    except UsageError as e:
        print(f"dsv4: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def check_output_dir(path: Path, flag: str, names: tuple[str, ...] = ()) -> None:
    """A folder that will receive outputs (created if missing), and each of `names` in it."""
    kind = describe(path)
    if kind not in (None, "a directory"):
        raise UsageError(f"{flag} {path}: is {kind}; give a folder")
    for p in dict.fromkeys((path.absolute(), Path(os.path.realpath(path)))):
        if read_manifest(p) is not None or (p / JOURNAL).exists():
            raise UsageError(f"{flag} {path}: is a trunk pack; give another folder")
        if any(p.glob(f"*{STATE_SUFFIX}")):
            raise UsageError(f"{flag} {path}: is a kv cache folder; give another folder")
    if path.is_dir():
        for name in names:
            check_output(path / name, flag)
