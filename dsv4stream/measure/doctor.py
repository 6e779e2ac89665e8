"""What decides speed on this machine: drive read bandwidth, memory, and what the model needs.

Owns: the measurements behind `dsv4 doctor` (O_DIRECT reads of expert-sized blocks at a
few queue depths on the checkpoint's drive, RAM and free memory, VRAM when CuPy works) and
the advice derived from them with the planner (working set, smallest budget, recommended
budget with the expected hit-rate range). Reads use the expert store's `FileSet`, so the
figure is the one the runner will see.
"""

from __future__ import annotations

import errno
import itertools
import os
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import psutil

from ..checkpoint.config import SUPPORTED_MODEL_TYPES, ModelConfig
from ..run.planner import ENGRAM_SHARE, GB, MemoryNeeds, Plan, gb_up, minimum_budget, plan, smallest_budget
from ..store.directio import ALIGN, FileSet, Window, aligned_buffer

# LRU hit rates another engine reported publicly on the real V4-Flash: about 0 / 40 / 53% at
# 1.6 / 5.6 / 9.6 GB of expert cache (docs/real-models.md, "Speed to expect"),
# as (expert cache / 3.45 GB working set, low %, high %). Below one working set LRU never hits.
_HIT_POINTS = ((1.0, 0, 5), (1.63, 35, 45), (2.79, 48, 58))


@dataclass(frozen=True)
class ReadFigure:
    depth: int
    block: int
    gbps: float
    direct: bool


def read_bandwidth(path: Path, block: int, depths: tuple[int, ...], seconds: float = 1.0) -> list[ReadFigure]:
    """Random aligned reads of `block` bytes from `path`, `depth` threads at once, for ~`seconds` each."""
    size = path.stat().st_size
    block = max(ALIGN, block // ALIGN * ALIGN)
    if size < block:
        block = max(ALIGN, size // ALIGN * ALIGN)
    slots = size // block
    out = []
    for depth in depths:
        files = FileSet("direct", warn=lambda _m: None)
        bufs = [aligned_buffer(block) for _ in range(depth)]
        rng = random.Random(depth)
        deadline = time.perf_counter() + seconds

        def worker(buf, rng_seed: int, files=files, deadline=deadline) -> int:
            r = random.Random(rng_seed)
            n = 0
            while True:  # at least one read: a thread started late on a loaded machine still measures
                off = r.randrange(max(slots, 1)) * block
                n += files.read(Window(str(path), off, block, 0, min(block, size - off)), buf)
                if time.perf_counter() >= deadline:
                    return n

        t0 = time.perf_counter()
        with ThreadPoolExecutor(depth) as ex:
            total = sum(ex.map(worker, bufs, [rng.randrange(1 << 30) for _ in range(depth)]))
        dt = time.perf_counter() - t0
        out.append(ReadFigure(depth, block, total / dt / GB, bool(files.is_direct(str(path)))))
        files.close()
    return out


class ProbeFile:
    """What `read_bandwidth` reads: the largest shard under `target`, or a temporary file of
    `nbytes` written in `target` that has no name from the moment it exists.

    Why nameless: a doctor killed (kill -9, Ctrl-C, a closed terminal) while it writes or
    measures must not leave 512 MB behind. O_TMPFILE makes a file that never has a name;
    where the file system refuses it, the file is unlinked right after it is created. Either
    way it is read through /proc/self/fd/N (the same inode, opened again with O_DIRECT) and
    the kernel frees it when the descriptor closes, however the process ends."""

    def __init__(self, target: Path, nbytes: int = 512 << 20) -> None:
        self.fd: int | None = None
        shards = (
            sorted(target.glob("*.safetensors"), key=lambda p: p.stat().st_size, reverse=True)
            if target.is_dir()
            else []
        )
        if shards and shards[0].stat().st_size >= 64 << 20:
            self.path, self.label = shards[0], shards[0].name
            return
        d = target if target.is_dir() else target.parent
        self.fd = _nameless_file(d)
        self.path, self.label = Path(f"/proc/self/fd/{self.fd}"), f"a temporary file in {d}"
        try:
            chunk = os.urandom(1 << 20)
            for _ in range(nbytes >> 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(self.fd, view) :]
            os.fsync(self.fd)
        except BaseException:
            self.close()
            raise

    @property
    def temporary(self) -> bool:
        return self.fd is not None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _nameless_file(folder: Path) -> int:
    try:
        return os.open(folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (AttributeError, IsADirectoryError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, None):
            raise
    fd, name = tempfile.mkstemp(prefix=".dsv4-doctor-", dir=folder)
    os.unlink(name)
    return fd


def expected_hit_rate(cache_experts: int, working_set: int, total_experts: int) -> str:
    """Expected LRU hit rate for `cache_experts` slots, interpolated between public points."""
    if cache_experts >= total_experts:
        return "near 100% once warm (every expert fits; only first uses miss)"
    r = cache_experts / max(working_set, 1)
    if r < 1.0:
        return "0% (cache below the working set)"
    pts = _HIT_POINTS
    for (r0, lo0, hi0), (r1, lo1, hi1) in itertools.pairwise(pts):
        if r <= r1:
            f = (r - r0) / (r1 - r0)
            return f"{round(lo0 + f * (lo1 - lo0))}-{round(hi0 + f * (hi1 - hi0))}%"
    return f"above {pts[-1][1]}-{pts[-1][2]}% (the largest cache measured publicly)"


def memory_lines() -> list[str]:
    vm = psutil.virtual_memory()
    return [
        (
            f"cpus: {os.cpu_count()} (usable {len(os.sched_getaffinity(0))}), load average"
            f" {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
        ),
        f"memory: {vm.total / GB:.1f} GB total, {vm.available / GB:.1f} GB available",
    ]


def vram_line() -> str:
    try:
        import cupy
    except ImportError:
        return "vram: not checked, no CuPy (--gpu needs `pip install -e '.[gpu]'` and an NVIDIA GPU)"
    try:
        free, total = cupy.cuda.runtime.memGetInfo()
        return f"vram: {total / GB:.1f} GB total, {free / GB:.1f} GB free (CuPy {cupy.__version__})"
    except Exception as e:  # noqa: BLE001  any CUDA failure just means no usable GPU here
        first = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
        return f"vram: none usable, CuPy is installed but CUDA says: {first}"


def advice_lines(cfg: ModelConfig, needs: MemoryNeeds, available: int) -> list[str]:
    """Working set, smallest budget, and a recommended --budget for `available` bytes of RAM:
    the plan of the most this machine can give, at the smallest budget that gets that plan."""
    floor = minimum_budget(needs)
    want = min(needs.working_set, needs.total_experts)
    useful = smallest_budget(needs, lambda p: p.expert_slots >= want)
    name = SUPPORTED_MODEL_TYPES.get(cfg.model_type, cfg.model_type)
    lines = [
        (
            f"model: {name}, {cfg.n_layers} layers, {cfg.working_set_experts} experts per pass x"
            f" {cfg.expert_bytes:,} bytes = working set {cfg.working_set_bytes / GB:.2f} GB"
        ),
        f"smallest budget that runs: {gb_up(floor)} (trunk streamed, cache below the working set: hit rate near 0)",
    ]
    if cfg.engram is not None:
        e = cfg.engram
        lines.append(
            f"engram: {needs.engram_rows_per_token} rows per token ({e.row_bytes} bytes each, row and scales in two"
            f" 4 KiB pages far apart) from {needs.engram_table_bytes / GB:.2f} GB of tables left on disk; the row"
            f" cache is {ENGRAM_SHARE:.0%} of the budget"
        )
    if useful is not None:
        lines.append(f"smallest budget whose cache holds the working set: {gb_up(useful)}")
    # Leave 15% of available memory (at least 1 GB) for the OS and the page cache.
    cap = int(min(available * 0.85, available - GB))
    if cap < floor:
        lines.append(
            f"recommended --budget: none fits — {available / GB:.1f} GB available is below the {gb_up(floor)} minimum"
        )
        return lines
    best = plan(needs, cap)
    rec = smallest_budget(needs, lambda p: _covers(p, best)) or cap
    rec = min(rec, cap // (GB // 100) * (GB // 100))  # printed to 0.01 GB, never above the cap
    p = plan(needs, rec)
    everything = p.pinned_layers == len(needs.layer_bytes) and p.expert_slots >= needs.total_experts
    why = (
        "every trunk layer and every expert fits: more buys nothing"
        if everything
        else f"the most this machine leaves ({available / GB:.1f} GB available less 15% for the OS and page cache)"
    )
    hits = expected_hit_rate(p.expert_slots, needs.working_set, needs.total_experts)
    source = (
        "" if everything else " (from public V4-Flash measurements; real hit rates depend on the real model's routing)"
    )
    lines.append(
        f"recommended --budget {rec / GB:.2f}: {why}; {p.pinned_layers}/{cfg.n_layers} trunk layers resident,"
        f" {p.expert_slots} expert slots; expected LRU hit rate {hits}{source}"
    )
    return lines


def engram_read_line(cfg: ModelConfig, figures: list[ReadFigure]) -> str | None:
    """What 4 KiB random reads (`figures`, measured) mean for a token's Engram rows read cold:
    two pages a row (the row's, and its scales' about a table away), every row a miss."""
    if cfg.engram is None or not figures:
        return None
    best = max(figures, key=lambda f: f.gbps)
    per_s = best.gbps * 1e9 / best.block
    reads = 2 * cfg.engram.columns * len(cfg.engram.layer_ids)
    return (
        f"engram rows: {per_s:,.0f} random 4 KiB reads/s at queue depth {best.depth}: a token's {reads} page reads"
        f" take {reads / per_s * 1e3:.1f} ms when none is cached"
    )


def _covers(p: Plan, best: Plan) -> bool:
    return p.pinned_layers >= best.pinned_layers and p.expert_slots >= best.expert_slots
