"""Run a command under a memory limit: a cgroup of its own, below this process's, with the page
cache counted (so a memory-mapped model that does not fit is read again, as on a small machine).

Owns: finding where this process's memory cgroup is (cgroup v2, or v1's memory controller),
creating a child folder with the limit, starting a command inside it, its peak memory as the
kernel counts it (memory.peak / memory.max_usage_in_bytes: anonymous memory plus page cache), and
removing the folder after. `systemd-run --scope -p MemoryMax=` does the same where systemd runs
the machine; containers often have no systemd but let root create cgroup folders.
Also `evict(path)`: drop a file's pages from the page cache (posix_fadvise DONTNEED), so a
"cold" run starts with nothing of the model cached, without touching other programs' caches.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Limited:
    """What a command did under the limit."""

    returncode: int
    stdout: str
    stderr: str
    peak_bytes: int  # the cgroup's peak charge (anonymous memory and page cache)
    oom_killed: bool


def _own_cgroup() -> tuple[Path, str]:
    """(folder of this process's memory cgroup, "v2" or "v1")."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = CGROUP_ROOT / "memory" / path.lstrip("/")
            if folder.is_dir():
                return folder, "v1"
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            for base in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
                folder = base / path.lstrip("/")
                if (folder / "cgroup.controllers").is_file() and "memory" in (
                    folder / "cgroup.controllers"
                ).read_text():
                    return folder, "v2"
    raise UsageError("no memory cgroup found for this process (/proc/self/cgroup); run on Linux with cgroups")


def run_limited(
    cmd: list[str], limit_bytes: int, env: dict[str, str] | None = None, timeout: float | None = None
) -> Limited:
    """Run `cmd` in a new cgroup limited to `limit_bytes` (memory; swap too where there is any)."""
    parent, version = _own_cgroup()
    folder = parent / f"dsv4-limit-{uuid.uuid4().hex[:12]}"
    try:
        folder.mkdir()
    except OSError as e:
        raise UsageError(
            f"cannot create a cgroup under {parent} ({e.strerror}); run as root, or use"
            f" systemd-run --scope -p MemoryMax=... where systemd runs the machine"
        ) from None
    try:
        if version == "v2":
            (folder / "memory.max").write_text(str(limit_bytes))
            if (folder / "memory.swap.max").exists():
                (folder / "memory.swap.max").write_text("0")
        else:
            (folder / "memory.limit_in_bytes").write_text(str(limit_bytes))
            sw = folder / "memory.memsw.limit_in_bytes"
            if sw.exists():
                try:
                    sw.write_text(str(limit_bytes))
                except OSError:
                    pass  # memsw accounting off: no swap to limit
        procs = str(folder / "cgroup.procs")
        # the shell moves itself into the cgroup, then becomes the command: no window outside it
        wrapped = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *cmd]
        r = subprocess.run(wrapped, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        peak = _read_int(folder, "memory.peak" if version == "v2" else "memory.max_usage_in_bytes")
        return Limited(r.returncode, r.stdout, r.stderr, peak, _oom_killed(folder, version))
    finally:
        try:
            folder.rmdir()
        except OSError:
            pass  # a process still inside (it should have exited): left for the kernel to clean


def _read_int(folder: Path, name: str) -> int:
    try:
        return int((folder / name).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _oom_killed(folder: Path, version: str) -> bool:
    try:
        if version == "v2":
            text = (folder / "memory.events").read_text()
        else:
            text = (folder / "memory.oom_control").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key in ("oom_kill", "oom") and value.strip() not in ("", "0"):
            return True
    return False


def evict(path: str | os.PathLike) -> None:
    """Drop the page-cache pages of `path` (a file, or every file under a folder)."""
    p = Path(path)
    files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped: a file just written must reach the disk first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
