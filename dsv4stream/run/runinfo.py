"""What a run may use (`RunOptions`) and what it reports (`RunStats`, with its short summary).

Plain records: `runtime.Runtime` fills them, `report`, the REPL, the server and the CLI read them.
`RunStats` nests the providers' own stats and the sessions' phases; the flat names that
`--stats-json` has always written are read through to them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import IO

from ..engine.phases import PROFILE_LABELS, Phases
from ..gpu.context import GpuContext
from ..store.cache import StoreStats
from ..store.rowcache import RowStats
from ..streaming.ring import RingStats
from . import planner


@dataclass(frozen=True)
class RunOptions:
    """What a run may use. `budget` in bytes; `trunk`: a packed trunk directory, None for the
    default one when it exists (CHECKPOINT/dsv4-trunk), or "" to read the shards only."""

    budget: int
    io: str = "direct"
    verify: bool = False
    threads: int | None = None  # kernel threads
    io_threads: int = 4  # expert reader threads (queue depth)
    trunk: str | os.PathLike | None = None
    route_log: str | os.PathLike | IO[str] | None = None
    ctx: int = 4096  # longest sequence the state estimate covers
    chunk: int = planner.DEFAULT_CHUNK  # attention sub-chunk of a prefill segment
    overhead: int = planner.DEFAULT_OVERHEAD
    kept_states: int = 0  # session states a server keeps besides the live one (prefix reuse)
    live_sequences: int = 1  # sequences decoded together (`dsv4 serve --max-batch`): each holds a state
    prefill_segment: int | None = None  # tokens per prefill segment (None: the planner's choice)
    images: bool = False  # V4.1: the plan holds the vision tower and an image's activations
    gpu: GpuContext | None = None  # --gpu: trunk matrices in VRAM (None, or one not enabled: all on the CPU)
    # --numerics (`engine.numerics`): exact, official or fast, set by the engine for the process;
    # None: the family's reference mode (V4 exact, V4.1 official). The commands pass theirs (fast).
    numerics: str | None = None
    # --speculate: "auto", "off" or a draft length N (`engine.speculate`); where the checkpoint has a
    # drafter this code runs and it is not "off", the plan holds its dense weights and its experts
    # share the expert slots
    speculate: str | int = "auto"


class _Figure:
    """A figure of one of `RunStats`' nested records under the flat name `--stats-json` (and
    callers) have always used: `bytes_read` is `store.bytes_read`. `missing`: its value when
    the record is absent (no Engram)."""

    def __init__(self, record: str, attr: str, missing: object = None) -> None:
        self.record, self.attr, self.missing = record, attr, missing

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None):
        if obj is None:
            return self
        rec = getattr(obj, self.record)
        return self.missing if rec is None else getattr(rec, self.attr)


@dataclass(frozen=True)
class RunStats:
    """Figures of a run so far: the expert store's, the trunk ring's and the Engram cache's own
    stats and the sessions' phases, nested as they come, beside the run's own figures. Bytes are
    as read from disk. `as_dict` is the `--stats-json` document: one flat object (`FLAT`)."""

    store: StoreStats
    trunk: RingStats
    engram: RowStats | None  # V4.1's Engram row cache (None: the model has no Engram)
    phases: Phases
    working_set_experts: int
    peak_rss_bytes: int
    budget_bytes: int
    planned_bytes: int
    kernel_backend: str
    kernel_warmup_seconds: float = 0.0  # compiling or loading the kernels (numba cache), at open
    numerics: str = "exact"  # the run's numerics and, for fast, the CPU variant: "fast (avx512: vnni, bf16, vbmi)"
    warnings: list[str] = field(default_factory=list)
    prefill_segment: int = 0  # tokens per prefill segment the run used
    # most expert slots whose bytes a prefill segment's activations borrowed (back at decode)
    prefill_lent_slots: int = 0
    load_seconds: float = 0.0  # Runtime.open: catalog, plan, kernels, pinned trunk; before any prefill
    unused: str = ""  # what the checkpoint holds that is not run (the mtp.* blocks)
    # decode steps per kernel thread count ({"2": 118, "1": 6}) when the run chose them
    # (`engine/threads.py`); empty with --threads
    decode_threads: dict[str, int] = field(default_factory=dict)

    # the routed experts (`StoreStats`)
    expert_requests = _Figure("store", "requests")
    expert_hits = _Figure("store", "hits")
    expert_misses = _Figure("store", "misses")
    expert_evictions = _Figure("store", "evictions")
    expert_prefetches = _Figure("store", "prefetches")
    prefetch_used = _Figure("store", "prefetch_used")
    hit_rate = _Figure("store", "hit_rate")
    bytes_read = _Figure("store", "bytes_read")
    read_seconds = _Figure("store", "read_seconds")  # wall time with an expert read in flight
    read_gbps = _Figure("store", "read_gbps")
    exposed_io_seconds = _Figure("store", "wait_seconds")  # the forward blocked on expert reads: I/O not hidden
    verified_reads = _Figure("store", "verified_reads")
    verify_mismatches = _Figure("store", "verify_mismatches")
    cache_slots = _Figure("store", "slots")
    slot_bytes = _Figure("store", "slot_bytes")
    io_fallback_files = _Figure("store", "fallback_files")
    # the trunk (`RingStats`)
    trunk_pinned_layers = _Figure("trunk", "pinned_layers")
    trunk_streamed_layers = _Figure("trunk", "streamed_layers")
    trunk_reads = _Figure("trunk", "reads")
    trunk_bytes_read = _Figure("trunk", "bytes_read")
    trunk_wait_seconds = _Figure("trunk", "wait_seconds")
    trunk_out_of_order = _Figure("trunk", "out_of_order")  # layer requests that broke the fixed order
    trunk_verified_reads = _Figure("trunk", "verified_reads")
    # the generate calls (`Phases`): prefill and decode, one list entry per call (a chat turn)
    generated_ids = _Figure("phases", "generated_ids")
    prompt_tokens = _Figure("phases", "prompt_tokens")
    prefill_seconds = _Figure("phases", "prefill_seconds")
    decode_tokens = _Figure("phases", "decode_tokens")
    decode_seconds_per_token = _Figure("phases", "decode_seconds_per_token")  # decode only: prefill excluded
    prefill_tokens_per_second = _Figure("phases", "prefill_tokens_per_second")
    decode_tokens_per_second = _Figure("phases", "decode_tokens_per_second")
    turn_prompt_tokens = _Figure("phases", "turn_prompt_tokens")
    first_token_seconds = _Figure("phases", "first_token_seconds")
    prefill_stopped = _Figure("phases", "prefill_stopped")  # where an interrupted prefill stopped
    # seconds per decode step by PROFILE_PHASES: the products of routed-expert, trunk and head
    # weights, blocked on expert / trunk reads, choosing the token, and the rest
    decode_profile = _Figure("phases", "decode_profile")
    stop_reasons = _Figure("phases", "stop_reasons")  # why each call ended: engine.STOP_REASONS
    stop_reason = _Figure("phases", "stop_reason")
    stopped_in_think = _Figure("phases", "stopped_in_think")  # the turn ended before </think>
    decode_expert_bytes_per_token = _Figure("phases", "decode_expert_bytes_per_token")  # prefills' reads excluded
    decode_engram_bytes_per_token = _Figure("phases", "decode_engram_bytes_per_token")
    # V4.1's Engram row cache (`RowStats`; all 0 without Engram): rows asked for, found, read
    engram_cache_rows = _Figure("engram", "capacity", 0)
    engram_requests = _Figure("engram", "requests", 0)
    engram_hits = _Figure("engram", "hits", 0)
    engram_misses = _Figure("engram", "misses", 0)
    engram_hit_rate = _Figure("engram", "hit_rate", 0.0)
    engram_rows_read = _Figure("engram", "rows_read", 0)
    engram_bytes_read = _Figure("engram", "bytes_read", 0)  # aligned: a row and its scales are two 4 KiB pages
    engram_wait_seconds = _Figure("engram", "wait_seconds", 0.0)  # the forward blocked on Engram reads

    @property
    def speculation(self) -> dict | None:
        """--speculate's figures summed over the run's generate calls that could draft (`SpecCounts`):
        acceptance, mean accepted length, drafted and verified tokens, expert bytes per token, the
        decode time with drafts and the estimate without; None where none could."""
        spec = self.phases.speculation
        return spec.as_dict() if spec is not None else None

    @property
    def io_mode(self) -> str:
        s = self.store
        return f"{s.io} (buffered fallback)" if s.fallback_files else s.io

    def as_dict(self) -> dict:
        """The `--stats-json` document: every figure under its flat name, in `FLAT`'s order."""
        return {name: _plain(getattr(self, name)) for name in FLAT}

    def lines(self) -> list[str]:
        """A short human summary."""
        gb = 1e9
        out = [
            (
                f"experts: {self.expert_requests} requests, {self.expert_hits} hits ({self.hit_rate:.1%}),"
                f" {self.expert_misses} misses, {self.bytes_read / gb:.3f} GB read at {self.read_gbps:.2f} GB/s,"
                f" {self.exposed_io_seconds:.2f} s waiting on reads; cache {self.cache_slots} slots"
                f" (working set {self.working_set_experts}"
                + (f"; a prefill segment borrowed {self.prefill_lent_slots} of them" if self.prefill_lent_slots else "")
                + ")"
            ),
            *self._engram_lines(),
            f"trunk: {self.trunk_pinned_layers} layers pinned, {self.trunk_streamed_layers} streamed"
            + (
                f" ({self.trunk_reads} reads, {self.trunk_bytes_read / gb:.3f} GB, {self.trunk_wait_seconds:.2f} s waiting)"
                if self.trunk_streamed_layers
                else ""
            ),
            (
                f"time: prefill {self.prompt_tokens} tokens in {self.prefill_seconds:.2f} s,"
                f" decode {self.decode_seconds_per_token:.3f} s/token over {self.decode_tokens} tokens"
                f" (kernels: {self.kernel_backend}, numerics {self.numerics}, ready in {self.kernel_warmup_seconds:.2f} s)"
            ),
            *self._profile_lines(),
            *self._thread_lines(),
            f"memory: peak RSS {self.peak_rss_bytes / gb:.3f} GB of --budget {self.budget_bytes / gb:.3f} GB"
            + (
                f"; verified {self.verified_reads} expert reads, {self.verify_mismatches} mismatches"
                if self.verified_reads
                else ""
            ),
        ]
        return out + [f"warning: {w}" for w in self.warnings]

    def _engram_lines(self) -> list[str]:
        if not self.engram_cache_rows:
            return []
        return [
            (
                f"engram: {self.engram_requests} rows asked, {self.engram_hits} hits ({self.engram_hit_rate:.1%}),"
                f" {self.engram_rows_read} rows read ({self.engram_bytes_read / 1e9:.3f} GB),"
                f" {self.engram_wait_seconds:.2f} s waiting on reads; cache {self.engram_cache_rows} rows"
            )
        ]

    def _thread_lines(self) -> list[str]:
        counts = self.decode_threads
        if len(counts) < 2:  # one count throughout: nothing was chosen
            return []
        parts = ", ".join(f"{n} steps at {c}" for c, n in counts.items())
        return [f"decode threads (timed, chosen per step): {parts}"]

    def _profile_lines(self) -> list[str]:
        p = self.decode_profile
        total = sum(p.values())
        if not total:
            return []
        parts = ", ".join(f"{PROFILE_LABELS[k]} {v * 1e3:.1f} ms ({v / total:.0%})" for k, v in p.items())
        return [f"decode per token ({total * 1e3:.1f} ms): {parts}"]


# The keys of `--stats-json`, in order (the same document as before the records were nested)
FLAT = (
    "generated_ids", "prompt_tokens", "expert_requests", "expert_hits", "expert_misses", "expert_evictions",
    "expert_prefetches", "prefetch_used", "hit_rate", "bytes_read", "read_seconds", "read_gbps",
    "exposed_io_seconds", "verified_reads", "verify_mismatches", "cache_slots", "slot_bytes",
    "working_set_experts", "trunk_pinned_layers", "trunk_streamed_layers", "trunk_reads", "trunk_bytes_read",
    "trunk_wait_seconds", "trunk_out_of_order", "trunk_verified_reads", "peak_rss_bytes", "budget_bytes",
    "planned_bytes", "io_mode", "io_fallback_files", "kernel_backend", "prefill_seconds", "decode_tokens",
    "decode_seconds_per_token", "prefill_tokens_per_second", "turn_prompt_tokens", "first_token_seconds",
    "warnings", "kernel_warmup_seconds", "prefill_segment", "prefill_stopped", "decode_profile", "load_seconds",
    "decode_tokens_per_second", "stop_reasons", "stop_reason", "stopped_in_think", "unused", "engram_cache_rows",
    "engram_requests", "engram_hits", "engram_misses", "engram_hit_rate", "engram_rows_read", "engram_bytes_read",
    "engram_wait_seconds", "decode_expert_bytes_per_token", "decode_engram_bytes_per_token", "decode_threads",
    "numerics", "speculation",
)  # fmt: skip


def _plain(v: object) -> object:
    """A copy JSON takes as it is (the records' lists and dicts are not handed out)."""
    return list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
