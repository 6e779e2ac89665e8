"""`--speculate auto`'s memory between runs: what a run measured, for the next run's first reply.

Owns: `SpecMemory` (one key's file: `load` gives `spec_policy.Remembered` or None, `save` writes
one) and `memory_key` (the key: what a remembered figure is only valid for). The policy's use of
it is `spec_policy`'s (`AutoDrafts.remembered`, `AutoDrafts.remember`).

Why: `auto` learns a drafter's cost and acceptance by running it. A run keeps one policy for all
its replies (a server, a chat), but every `dsv4 run` started afresh and paid that lesson again
on each prompt: on demo-v41 in RAM one drafter run costs 0.6-0.9 of a step, 0.5-0.7 % of a
128-token reply, about the whole noise of a quiet machine. What it learned is a property of the
drafter, the checkpoint and the machine, so it is kept per key:
  checkpoint (`Catalog.fingerprint`), drafter design, numerics, what the budget's plan keeps
  resident (layers; the expert cache in 5 % steps: not the budget itself, whose default moves
  with the memory available), kernel threads, packed or not, `--gpu`, CPU (model and SIMD
  features)
and a run with another of any of these learns afresh. The acceptance is a prior worth at most
`spec_policy.REMEMBERED_DRAFTS` drafts, checked by one watch before drafting on it: another
prompt may suit the drafter less.

Files: `files.state_dir() / "speculation" / KEY.json`, written atomically (`files.atomic_write`:
a crash leaves the old file or the new one; two processes: the last one's). A file that does not
parse or holds values out of range is ignored (one warning; the run learns afresh) and replaced
at the next save; a folder that cannot be written costs only the memory (one warning).
`DSV4_SPECULATE_MEMORY=off` turns the memory off; deleting the folder forgets everything.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

from ..errors import Dsv4Error
from ..files import atomic_write, read_regular, state_dir
from .spec_policy import Remembered

VERSION = 1
OFF_VALUES = ("off", "0", "no", "false")


def memory_key(parts: Mapping[str, object]) -> str:
    """The file name's key: a hash of what the figures hold for (see the module docstring)."""
    text = json.dumps({k: str(v) for k, v in sorted(parts.items())}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def enabled() -> bool:
    return os.environ.get("DSV4_SPECULATE_MEMORY", "on").strip().lower() not in OFF_VALUES


def _finite(x: object, low: float, high: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and low <= x <= high


def parse(data: object) -> Remembered | None:
    """A file's JSON as `Remembered`, or None where any field is missing, of another type or out
    of range (a hand-edited or foreign file must not steer the policy)."""
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return None
    keys = ("draft_share", "accepted", "rejected", "confidence", "runs", "cold_share")
    share, acc, rej, conf, runs, cold = (data.get(k) for k in keys)
    if any(x is not None and not _finite(x, 0.0, 1e3) for x in (share, cold)):
        return None
    if not (_finite(acc, 0.0, 1e9) and _finite(rej, 0.0, 1e9)):
        return None
    if conf is not None and not _finite(conf, 0.0, 1.0):
        return None
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 1:
        return None
    opt = lambda x: None if x is None else float(x)
    return Remembered(opt(share), float(acc), float(rej), opt(conf), runs, opt(cold))


class SpecMemory:
    """One key's remembered figures. `warn` gets one line per problem (unreadable, unwritable)."""

    def __init__(self, path: Path, warn: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.warn = warn
        self._warned: set[str] = set()

    @classmethod
    def for_run(cls, parts: Mapping[str, object], warn: Callable[[str], None] | None = None) -> SpecMemory | None:
        """The memory of a run described by `parts`, or None where it is turned off."""
        if not enabled():
            return None
        return cls(state_dir() / "speculation" / f"{memory_key(parts)}.json", warn)

    def _say(self, kind: str, msg: str) -> None:
        if self.warn is not None and kind not in self._warned:
            self._warned.add(kind)
            self.warn(msg)

    def load(self) -> Remembered | None:
        if not self.path.exists() and not self.path.is_symlink():
            return None
        try:  # never blocks on a FIFO put there, never reads a huge file
            raw = read_regular(self.path, "the speculation memory", limit=1 << 16)
            got = parse(json.loads(raw))
        except Dsv4Error as e:
            self._say("read", f"--speculate auto: {e}; learning afresh")
            return None
        except (ValueError, UnicodeDecodeError):
            got = None
        if got is None:
            self._say(
                "read",
                f"--speculate auto: {self.path} is not a memory this version wrote; learning afresh (replaced at the end of the reply)",
            )
        return got

    def save(self, rec: Remembered) -> None:
        data = {"version": VERSION, **asdict(rec)}
        if self.path.is_symlink() or (self.path.exists() and not self.path.is_file()):
            # not a file this module wrote: never written through or over
            self._say(
                "write",
                f"--speculate auto: {self.path} is not a regular file; not writing over it (the next run learns afresh)",
            )
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, json.dumps(data, indent=1) + "\n")
        except (OSError, Dsv4Error) as e:
            self._say(
                "write",
                f"--speculate auto: cannot keep what this run measured ({self.path}: {getattr(e, 'strerror', None) or e}); the next run learns afresh",
            )
