"""What a run may use (`RunOptions`) and what it reports (`RunStats`, with its short summary).

Plain records: `runtime.Runtime` fills them, `report`, the REPL, the server and the CLI read them.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import IO

from ..gpu.context import GpuContext
from . import planner
from .profile import PROFILE_LABELS


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
    prefill_segment: int | None = None  # tokens per prefill segment (None: the planner's choice)
    gpu: GpuContext | None = None  # --gpu: trunk matrices in VRAM (None, or one not enabled: all on the CPU)


@dataclass(frozen=True)
class RunStats:
    """Figures of a run so far (JSON-ready through `as_dict`). Bytes are as read from disk."""

    generated_ids: list[int]
    prompt_tokens: int
    expert_requests: int
    expert_hits: int
    expert_misses: int
    expert_evictions: int
    expert_prefetches: int
    prefetch_used: int
    hit_rate: float
    bytes_read: int  # routed experts
    read_seconds: float  # wall time with an expert read in flight
    read_gbps: float
    exposed_io_seconds: float  # time the forward blocked on expert reads: I/O not hidden
    verified_reads: int
    verify_mismatches: int
    cache_slots: int
    slot_bytes: int
    working_set_experts: int
    trunk_pinned_layers: int
    trunk_streamed_layers: int
    trunk_reads: int
    trunk_bytes_read: int
    trunk_wait_seconds: float
    trunk_out_of_order: int  # layer requests that broke the fixed order (read without overlap)
    trunk_verified_reads: int
    peak_rss_bytes: int
    budget_bytes: int
    planned_bytes: int
    io_mode: str
    io_fallback_files: int
    kernel_backend: str
    prefill_seconds: float
    decode_tokens: int
    decode_seconds_per_token: float  # decode only: prefill excluded
    prefill_tokens_per_second: float
    # one entry per `generate` call (a chat turn): tokens prefilled, seconds to its first token
    turn_prompt_tokens: list[int] = field(default_factory=list)
    first_token_seconds: list[float] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    kernel_warmup_seconds: float = 0.0  # compiling or loading the kernels (numba cache), at open
    prefill_segment: int = 0  # tokens per prefill segment the run used
    prefill_stopped: str = ""  # where an interrupted prefill stopped ("" when none was)
    # seconds per decode step by phase (PROFILE_PHASES): the products of routed-expert, trunk and
    # head weights, blocked on expert / trunk reads, choosing the token, and the rest
    decode_profile: dict[str, float] = field(default_factory=dict)
    load_seconds: float = 0.0  # Runtime.open: catalog, plan, kernels, pinned trunk; before any prefill
    decode_tokens_per_second: float = 0.0
    # why each generate call (chat turn) ended: one of engine.STOP_REASONS; the last one on its own
    stop_reasons: list[str] = field(default_factory=list)
    stop_reason: str = ""
    stopped_in_think: list[bool] = field(default_factory=list)  # the turn ended before </think>
    unused: str = ""  # what the checkpoint holds that is not run (the mtp.* blocks)

    def as_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """A short human summary."""
        gb = 1e9
        out = [
            (
                f"experts: {self.expert_requests} requests, {self.expert_hits} hits ({self.hit_rate:.1%}),"
                f" {self.expert_misses} misses, {self.bytes_read / gb:.3f} GB read at {self.read_gbps:.2f} GB/s,"
                f" {self.exposed_io_seconds:.2f} s waiting on reads; cache {self.cache_slots} slots"
                f" (working set {self.working_set_experts})"
            ),
            f"trunk: {self.trunk_pinned_layers} layers pinned, {self.trunk_streamed_layers} streamed"
            + (
                f" ({self.trunk_reads} reads, {self.trunk_bytes_read / gb:.3f} GB, {self.trunk_wait_seconds:.2f} s waiting)"
                if self.trunk_streamed_layers
                else ""
            ),
            (
                f"time: prefill {self.prompt_tokens} tokens in {self.prefill_seconds:.2f} s,"
                f" decode {self.decode_seconds_per_token:.3f} s/token over {self.decode_tokens} tokens"
                f" (kernels: {self.kernel_backend}, ready in {self.kernel_warmup_seconds:.2f} s)"
            ),
            *self._profile_lines(),
            f"memory: peak RSS {self.peak_rss_bytes / gb:.3f} GB of --budget {self.budget_bytes / gb:.3f} GB"
            + (
                f"; verified {self.verified_reads} expert reads, {self.verify_mismatches} mismatches"
                if self.verified_reads
                else ""
            ),
        ]
        return out + [f"warning: {w}" for w in self.warnings]

    def _profile_lines(self) -> list[str]:
        p = self.decode_profile
        total = sum(p.values())
        if not total:
            return []
        parts = ", ".join(f"{PROFILE_LABELS[k]} {v * 1e3:.1f} ms ({v / total:.0%})" for k, v in p.items())
        return [f"decode per token ({total * 1e3:.1f} ms): {parts}"]
