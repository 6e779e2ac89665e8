"""Which CPUs the CPU kernels use and which one the GPU-driving thread gets.

Owns: the pure split of a CPU set into compute CPUs and one reserved CPU
(`split_affinity`), reading SMT siblings from sysfs, and applying a split to the threads
of this process (and undoing it).

Why reserve a core: the thread that drives a GPU spins in `cudaStreamSynchronize` while
the device works. On a machine whose every core runs a CPU kernel thread, that spinning
thread steals a slice of one core, its kernel thread becomes the straggler every parallel
loop waits for, and a C engine measured CPU matmuls 30x slower. With one core left to the
GPU thread (and its SMT siblings left idle, so the spin does not share a physical core
with a kernel thread) the CPU kernels run at full speed on the others.

Linux `sched_setaffinity(tid)` acts on one thread; threads inherit the mask of the thread
that creates them. So the GPU thread pins itself, and every other thread of the process
(main, numpy/BLAS and numba pools, readers) is moved to the compute CPUs; pools started
later inherit that from the main thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class AffinitySplit:
    compute: tuple[int, ...]  # CPUs for the main thread and the CPU kernel threads
    gpu: int | None  # CPU reserved for the GPU-driving thread; None: nothing reserved or pinned
    threads: int  # CPU kernel thread count
    note: str  # one line saying what was decided and why


def split_affinity(
    cpus: Iterable[int],
    threads: int | None,
    gpu: bool,
    siblings: Mapping[int, Iterable[int]] | None = None,
) -> AffinitySplit:
    """Split the usable CPUs between the CPU kernels and the GPU-driving thread.

    threads: the user's explicit `--threads` (None: not given). An explicit count is taken
    as is and nothing is pinned. With `gpu` and no explicit count, the highest-numbered CPU
    is reserved for the GPU thread, its SMT siblings (from `siblings`) are left idle when
    other CPUs remain, and the kernels get one thread per remaining CPU.
    """
    cpu_list = tuple(sorted(set(cpus)))
    if not cpu_list:
        raise ValueError("empty CPU set")
    n = len(cpu_list)
    if threads is not None and threads < 1:
        raise ValueError(f"thread count must be at least 1, found {threads}")
    if not gpu:
        return AffinitySplit(cpu_list, None, threads or n, "")
    if threads is not None:
        return AffinitySplit(cpu_list, None, threads, f"--threads {threads} given: no CPU reserved for the GPU thread")
    if n == 1:
        return AffinitySplit(cpu_list, None, 1, "one usable CPU: no CPU reserved for the GPU thread")
    reserved = cpu_list[-1]
    sib = set(siblings.get(reserved, ())) if siblings else set()
    compute = tuple(c for c in cpu_list if c != reserved and c not in sib)
    idle = ""
    if not compute:
        compute = tuple(c for c in cpu_list if c != reserved)
    elif len(compute) < n - 1:
        idle = f", its SMT sibling{'s' if len(compute) < n - 2 else ''} idle"
    note = f"CPU kernels on {len(compute)} thread{'s' if len(compute) > 1 else ''} ({_ranges(compute)}), GPU thread on CPU {reserved}{idle}"
    return AffinitySplit(compute, reserved, len(compute), note)


def _ranges(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> 'CPUs 0-2,5'."""
    parts: list[str] = []
    start = prev = cpus[0]
    for c in (*cpus[1:], None):
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ("CPU " if len(cpus) == 1 else "CPUs ") + ",".join(parts)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """sysfs list syntax '0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return tuple(out)


def cpu_siblings(cpus: Iterable[int], root: str = "/sys/devices/system/cpu") -> dict[int, tuple[int, ...]]:
    """CPU -> its SMT siblings (itself excluded), from sysfs; {} where sysfs says nothing."""
    out: dict[int, tuple[int, ...]] = {}
    for c in cpus:
        p = Path(root) / f"cpu{c}" / "topology" / "thread_siblings_list"
        try:
            sib = parse_cpu_list(p.read_text())
        except (OSError, ValueError):
            continue
        out[c] = tuple(s for s in sib if s != c)
    return out


def usable_cpus() -> tuple[int, ...]:
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def pin_current_thread(cpu: int) -> str | None:
    """Pin the calling thread to one CPU; returns None, or why it could not."""
    return set_current_thread({cpu})


def set_current_thread(cpus: Iterable[int]) -> str | None:
    """Set the calling thread's CPU mask; returns None, or why it could not."""
    cpus = set(cpus)
    try:
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError) as e:
        return f"could not pin the GPU thread to {_ranges(tuple(sorted(cpus)))} ({e})"
    return None


def thread_ids() -> list[int]:
    """Native ids of this process's threads (Linux); [] where /proc is missing."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def move_threads(cpus: Iterable[int], exclude: Iterable[int] = ()) -> dict[int, frozenset[int]]:
    """Set the affinity of every thread but `exclude` to `cpus`; returns the previous masks."""
    target = set(cpus)
    skip = set(exclude)
    previous: dict[int, frozenset[int]] = {}
    for tid in thread_ids():
        if tid in skip:
            continue
        try:
            previous[tid] = frozenset(os.sched_getaffinity(tid))
            os.sched_setaffinity(tid, target)
        except OSError:
            continue  # the thread ended meanwhile, or we may not touch it
    return previous


def restore_threads(previous: Mapping[int, Iterable[int]]) -> None:
    """Undo `move_threads` for the threads that still exist."""
    for tid, mask in previous.items():
        try:
            os.sched_setaffinity(tid, set(mask))
        except OSError:
            continue
