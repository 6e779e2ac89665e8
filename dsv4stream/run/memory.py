"""Memory: what this process holds (`peak_rss_bytes`) and what a run on a checkpoint will hold.

Owns: measuring the plan's inputs from the actual checkpoint (`memory_needs`: layer and head
groups as they are read, the expert slot size, state and staging estimates (one state per
sequence decoded together and per kept state), the baseline overhead), the one answer inspect,
doctor and bench give (`needs_of`), and how many requests a server decodes together by
default (`max_batch_for`). Placing them is `planner`'s job; opening the run is `runtime`'s.
"""

from __future__ import annotations

import ctypes
import os
import resource
from pathlib import Path

from .. import kernels
from ..checkpoint.catalog import Catalog
from ..checkpoint.spec import drafter_summary, unused_summary
from ..checkpoint.spec_v41 import is_vision
from ..checkpoint.tensors import MODEL, is_drafter
from ..kernels import reference
from ..store import ExpertStore
from ..streaming.expert_layout import expert_layouts
from ..streaming.layout import TrunkLayout, trunk_layout, without
from ..trunkpack.reader import open_trunk_file
from . import planner, planner_dspark, planner_head
from .planner import MemoryNeeds
from .runinfo import RunOptions

HEAD_MATRIX = frozenset({MODEL["head"] + ".weight"})  # what stays on disk in `planner_head.INT8`
DEFAULT_MAX_BATCH = 4  # requests `dsv4 serve` decodes together when --max-batch is not given


def max_batch_for(state_bytes: int, budget: int, most: int = DEFAULT_MAX_BATCH) -> int:
    """How many requests `dsv4 serve` decodes together by default: `most`, fewer where their states
    for --ctx (`state_bytes` each) would take more than a tenth of the budget, which the trunk
    and the experts need. The plan then holds that many states (`RunOptions.live_sequences`)."""
    return max(1, min(most, budget // 10 // max(state_bytes, 1)))


def peak_rss_bytes() -> int:
    """This process's peak resident set (the kernel's VmHWM, in bytes).

    Not getrusage's ru_maxrss: across fork + exec that figure keeps the parent's peak (the
    pre-exec address space is the parent's), so a run started from a large process (a test
    runner, `dsv4 bench`) would report the parent's memory as its own."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trim_heap() -> None:
    """Give the C heap's free pages back to the kernel (glibc's malloc_trim; nothing elsewhere).

    A prefill segment's arrays are freed into the heap, which keeps them (`recycle_heap`); the
    expert slots that take those bytes back would then sit on top of them, past the budget."""
    trim = _libc("malloc_trim")
    if trim is not None:
        trim(0)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1


def recycle_heap() -> bool:
    """From now on, keep freed memory in the C heap for the next allocation (glibc: every
    allocation from the heap, none returned by free; `trim_heap` returns it). False where the
    C library has no mallopt (then nothing changes).

    Why: by default glibc maps each array over its mmap threshold (at most 32 MiB) afresh and
    unmaps it on free, so every prefill layer's activations are new pages the kernel must
    fault in and zero again; under a hypervisor that reclaims a guest's free pages, each fault
    also waits on the host. A 2048-token prefill on a 4-layer Flash-width checkpoint took
    93-330k page faults and 2.8-4.2 s of system time a prefill; with the heap recycled, under
    700 faults and 0.03-0.08 s, at the same peak RSS (docs/performance.md). What the budget
    counts is unchanged: the heap holds what a segment's activations held at their peak, and
    `Runtime.make_room` trims it before expert slots take those bytes back."""
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX))


def _libc(name: str):
    """The C library's function `name`, or None where it has none (not glibc)."""
    if name not in _LIBC:
        try:
            _LIBC[name] = getattr(ctypes.CDLL(None), name)
        except (OSError, AttributeError):
            _LIBC[name] = None
    return _LIBC[name]


_LIBC: dict[str, object] = {}


def kernel_scratch_bytes(cat: Catalog) -> int:
    """Float32 scratch the kernels allocate for the largest linear (the numpy reference
    dequantises row blocks; the fused backend's tile buffers are part of the overhead)."""
    if kernels.backend_name() != "reference":
        return 0
    most = 0
    for e in cat.entries.values():
        if len(e.shape) == 2 and e.dtype in ("F8_E4M3", "I8", "BF16", "F32"):
            cols = e.shape[1] * (2 if e.dtype == "I8" else 1)
            most = max(most, reference.scratch_bytes(e.shape[0], cols))
    return most


def runs_drafter(cat: Catalog, opts: RunOptions) -> bool:
    """Whether this run drafts: --speculate not off and a drafter this code runs."""
    return planner_dspark.drafts(cat.config, opts.speculate)


def drafter_dense_bytes(cat: Catalog) -> int:
    """The drafter's weights as its loader holds them (`run.planner_dspark.dense_bytes`)."""
    return planner_dspark.dense_bytes(
        (n, e.shape, e.nbytes) for n, e in cat.entries.items() if is_drafter(n) and ".ffn.experts." not in n
    )


def memory_needs(
    cat: Catalog, layout: TrunkLayout, slot_bytes: int, opts: RunOptions, head_q8_bytes: int = 0
) -> MemoryNeeds:
    """What the plan must place, measured on this checkpoint (layer groups as read, with
    their aligned windows), plus the state / staging estimates and the baseline overhead.
    A run that drafts (`runs_drafter`) holds the drafter's dense weights too; `head_q8_bytes`:
    the int8 head copy a fast run can read (`head_q8_bytes_of`), which the plan then takes in
    place of the BF16 head matrix (`planner_head`)."""
    cfg = cat.config
    drafts = runs_drafter(cat, opts)
    needs = MemoryNeeds(
        layer_bytes=layout.layer_bytes,
        head_bytes=layout.head.nbytes + cfg.tid2eid_bytes,  # V4.1: head and final norm only (no hc_head)
        head_matrix_bytes=layout.head.nbytes - without(layout.head, HEAD_MATRIX).nbytes,
        slot_bytes=slot_bytes,
        state_bytes=planner.state_bytes_for(cfg, opts.ctx) * (opts.live_sequences + opts.kept_states),
        staging_bytes=planner.staging_bytes_for(cfg, opts.chunk, opts.ctx) + kernel_scratch_bytes(cat),
        overhead_bytes=opts.overhead,
        working_set=cfg.working_set_experts,
        experts_per_token=cfg.num_experts_per_tok,
        total_experts=cfg.n_layers * cfg.n_routed_experts + (planner_dspark.drafter_experts(cfg) if drafts else 0),
        segment_token_bytes=planner.segment_token_bytes(cfg),
        segment_min=opts.chunk,
        segment=opts.prefill_segment,
        unused=_unused(cat, opts.images, drafts),
        drafter_bytes=drafter_dense_bytes(cat) if drafts else 0,
        head_q8_bytes=head_q8_bytes,
        engram_slot_bytes=planner.family_planner(cfg).engram_slot_bytes(cfg),
        engram_rows_per_token=planner.family_planner(cfg).engram_rows_per_token(cfg),
        engram_table_bytes=sum(e.nbytes for n, e in cat.entries.items() if ".engram.embed." in n),
        **vision_needs(cat, opts.images),
    )
    return planner_head.chosen(needs)  # its fixed bytes are the plan's


def _unused(cat: Catalog, images: bool, drafts: bool = False) -> str | None:
    """What is not run: mtp.* (unless this run drafts), and the vision tower unless this run takes images."""
    drafter = 0 if drafts else sum(e.nbytes for n, e in cat.entries.items() if is_drafter(n))
    if images:
        return (drafter_summary(cat.config, drafter) if not drafts else None) or None
    return unused_summary(
        cat.config, None if drafts else drafter, sum(e.nbytes for n, e in cat.entries.items() if is_vision(n))
    )


def vision_needs(cat: Catalog, images: bool) -> dict[str, int]:
    """The tower's bytes as stored (BF16) and its activations, when the run takes images."""
    cfg = cat.config
    if not images or cfg.vision is None:
        return {}
    return {
        "vision_weight_bytes": sum(e.nbytes for n, e in cat.entries.items() if is_vision(n)),
        "vision_activation_bytes": planner.family_planner(cfg).vision_activation_bytes(cfg),
    }


def main_expert_layouts(cat: Catalog, drafter: bool = False) -> tuple[dict, dict]:
    """Store layouts and piece orders of the main layers' experts, and with `drafter` those of the
    drafter's stages too (blocks n_layers + K: in the same store, the same slots, the same budget)."""
    n = cat.config.n_layers
    el = expert_layouts(cat.entries, n)
    end = n + (cat.config.n_mtp if drafter else 0)
    layouts = {k: v for k, v in el.layouts.items() if k[0] < end}
    return layouts, {k: el.order[k] for k in layouts}


def measure(checkpoint: str | os.PathLike, opts: RunOptions) -> MemoryNeeds:
    """MemoryNeeds of this checkpoint as `Runtime.open` would plan it (reads headers only)."""
    cat = Catalog.open(checkpoint)
    tf = open_trunk_file(cat, opts.trunk)
    layouts, _ = main_expert_layouts(cat, runs_drafter(cat, opts))
    q8 = head_q8_bytes_of(tf, cat.config.family, opts.numerics)
    return memory_needs(cat, trunk_layout(cat, tf), ExpertStore.slot_nbytes(layouts), opts, q8)


def copy_read(family: str, numerics: str | None) -> bool:
    """Whether a run with this --numerics reads a pack's int8 head copy on this CPU: fast numerics
    (the run default, but not `dsv4 logits`' family defaults) on a CPU target the copy's kernels
    run on (`kernels.head.copy_runs`)."""
    from ..engine.numerics import DEFAULTS, kernel_mode

    if kernel_mode(family, numerics or DEFAULTS[family]) != "fast":
        return False
    from ..kernels.head import copy_runs

    return copy_runs()


def head_q8_bytes_of(tf, family: str, numerics: str | None, head_on_gpu: bool = False) -> int:
    """The int8 head copy's bytes where this run can read it (`copy_read`, a pack that holds the
    copy, the head on the CPU); else 0. The plan then reads it (`planner_head`)."""
    if tf is None or tf.head_q8 is None or head_on_gpu or not copy_read(family, numerics):
        return 0
    return int(tf.head_q8["file_bytes"])


def needs_of(path: str | os.PathLike, ctx: int = 4096, numerics: str | None = None) -> tuple[MemoryNeeds, str]:
    """What the planner places for `path`, the one answer inspect, doctor and bench give:
    measured on a checkpoint directory exactly as `dsv4 run` plans it (default trunk, ctx,
    chunk, kernels, --numerics), else estimated from a bare config.json as a packed checkpoint
    runs (the int8 head copy where fast reads it); with where the sizes came from. `numerics`:
    None for the run default (fast)."""
    from ..engine.numerics import RUN_DEFAULT

    numerics = numerics or RUN_DEFAULT
    p = Path(path)
    if p.is_dir() and any(p.glob("*.safetensors")):
        opts = RunOptions(budget=planner.GB, ctx=ctx, numerics=numerics)
        return measure(p, opts), "measured on the checkpoint, as `dsv4 run` plans"
    from ..checkpoint.config import ModelConfig

    cfg = ModelConfig.from_json(p / "config.json" if p.is_dir() else p)
    needs = planner.needs_from_config(cfg, ctx=ctx, head_copy=copy_read(cfg.family, numerics))
    return needs, "estimated from config.json with the release dtypes, as a packed checkpoint runs"
