"""How a `--budget` is split: pinned trunk layers, a layer ring, the head, expert slots.

Owns: pure arithmetic from the model's byte sizes and a budget to a `Plan`, its printed
summary, the refusal of a budget that cannot work (naming the minimum), and the warning
when the expert cache is smaller than one forward pass's working set (an LRU then never
hits). It reads no files; `needs_from_config` estimates sizes from config.json alone (for
`inspect --config-only` and `doctor`), the runtime passes sizes measured from the catalog.

Why trunk layers are pinned before expert slots are added: a pinned layer saves its whole
size in reads on every token, while a cached expert saves its size only when it hits.
Layers are pinned in order (0, 1, ...); the rest stream through a ring of two layer slots
(read layer i+1 while computing layer i). The embedding is read by rows on demand.

Budgets are in decimal GB (10^9 bytes), the unit drives and `free` report.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import ModelConfig
from .errors import BudgetError
from .spec import block_specs, drafter_nbytes, drafter_summary, released_nbytes

GB = 1_000_000_000
ALIGN = 4096
# Interpreter, numpy/numba/tokenizers code and heaps, thread stacks, allocator slack:
# measured as peak RSS of a run whose weights are negligible (bench/overhead.py: 208 MB with
# the numba kernels, 118 MB with the numpy reference; python 3.11, 2 cpus), plus 15%.
DEFAULT_OVERHEAD = 240 * 1000 * 1000
DEFAULT_CHUNK = 64  # prefill tokens per forward: what a run stages for (RunOptions.chunk)


@dataclass(frozen=True)
class MemoryNeeds:
    """Resident byte sizes the plan has to place (all in bytes)."""

    layer_bytes: tuple[int, ...]  # dense weights of each main layer
    head_bytes: int  # head + final norm + hc_head
    slot_bytes: int  # one expert cache slot (aligned windows included)
    state_bytes: int  # KV window, compressed rows, compressor state for --ctx
    staging_bytes: int  # activations and per-chunk scratch
    overhead_bytes: int = DEFAULT_OVERHEAD
    working_set: int = 0  # experts one pass touches
    experts_per_token: int = 1
    total_experts: int = 0
    unused: str | None = None  # what the checkpoint holds that is not run (the mtp.* blocks), for the plan

    @property
    def fixed_bytes(self) -> int:
        """What every plan holds whatever the budget: overhead, state, staging, the head."""
        return self.overhead_bytes + self.state_bytes + self.staging_bytes + self.head_bytes

    @property
    def trunk_resident_bytes(self) -> int:
        """The fixed part plus every trunk layer pinned: the smallest plan without a ring."""
        return self.fixed_bytes + sum(self.layer_bytes)


@dataclass(frozen=True)
class Plan:
    budget: int
    needs: MemoryNeeds
    pinned_layers: int
    ring_slots: int
    ring_slot_bytes: int
    expert_slots: int
    warnings: tuple[str, ...] = field(default=())

    @property
    def streamed_layers(self) -> int:
        return len(self.needs.layer_bytes) - self.pinned_layers

    @property
    def pinned_bytes(self) -> int:
        return sum(self.needs.layer_bytes[: self.pinned_layers])

    @property
    def expert_bytes(self) -> int:
        return self.expert_slots * self.needs.slot_bytes

    @property
    def planned_bytes(self) -> int:
        return self.needs.fixed_bytes + self.pinned_bytes + self.ring_slots * self.ring_slot_bytes + self.expert_bytes

    def lines(self) -> list[str]:
        n = self.needs
        ws = n.working_set
        out = [
            (
                f"budget {_gb(self.budget)}: overhead {_gb(n.overhead_bytes)}, state {_gb(n.state_bytes)},"
                f" staging {_gb(n.staging_bytes)}, head {_gb(n.head_bytes)}"
            ),
            f"  trunk: {self.pinned_layers}/{len(n.layer_bytes)} layers pinned ({_gb(self.pinned_bytes)})"
            + (
                f", {self.streamed_layers} streamed through {self.ring_slots} x {_gb(self.ring_slot_bytes)} ring"
                if self.streamed_layers
                else ""
            ),
            (
                f"  experts: {self.expert_slots} slots x {_gb(n.slot_bytes)} = {_gb(self.expert_bytes)}"
                f" (working set per pass: {ws} experts{', all experts fit' if self.expert_slots >= n.total_experts else ''})"
            ),
            f"  planned total {_gb(self.planned_bytes)} of {_gb(self.budget)}",
        ]
        if n.unused:
            out.append(f"  {n.unused}")
        return out + [f"warning: {w}" for w in self.warnings]


def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= GB // 10 else f"{n / 1e6:.1f} MB"


def gb_up(n: int) -> str:
    """Bytes as GB rounded up to 0.01: a minimum must never print below itself."""
    return f"{math.ceil(n / GB * 100) / 100:.2f} GB"


def minimum_budget(needs: MemoryNeeds) -> int:
    """Smallest budget that runs: nothing pinned, a two-slot ring, two layers' worth of experts."""
    ring = 2 * max(needs.layer_bytes, default=0)
    slots = 2 * needs.experts_per_token * needs.slot_bytes
    return needs.fixed_bytes + ring + slots


def smallest_budget(needs: MemoryNeeds, ok: Callable[[Plan], bool], limit: int = 1 << 50) -> int | None:
    """Smallest budget, rounded up to 0.01 GB (as printed), whose plan satisfies `ok`; None
    below `limit`. Bisection: more budget never pins fewer layers or gives fewer slots."""
    step = GB // 100
    lo, hi = minimum_budget(needs), minimum_budget(needs)
    while not ok(plan(needs, hi)):
        if hi > limit:
            return None
        lo, hi = hi, hi * 2
    while hi - lo > GB // 1000:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(plan(needs, mid)) else (mid, hi)
    b = -(-hi // step) * step
    while not ok(plan(needs, b)):  # the ring's release at "all layers pinned" is the one kink
        b += step
    return b


def plan(needs: MemoryNeeds, budget: int, max_expert_slots: int | None = None) -> Plan:
    """Split `budget` bytes; raise BudgetError (naming the minimum) if it cannot work."""
    floor = minimum_budget(needs)
    if budget < floor:
        raise BudgetError(
            f"--budget {budget / GB:.2f} GB is below the minimum of {gb_up(floor)}"
            f" for this model (head {_gb(needs.head_bytes)}, overhead {_gb(needs.overhead_bytes)},"
            f" state for --ctx {_gb(needs.state_bytes)}, two streamed layers, {2 * needs.experts_per_token}"
            " expert slots); raise --budget (or lower --ctx)"
        )
    min_slots = 2 * needs.experts_per_token
    cap = needs.total_experts if max_expert_slots is None else max_expert_slots
    free = budget - needs.fixed_bytes - min_slots * needs.slot_bytes
    layers = needs.layer_bytes
    ring_slot = max(layers, default=0)
    pinned = 0
    if sum(layers) <= free:
        pinned, free = len(layers), free - sum(layers)
        ring_slots = 0
    else:
        free -= 2 * ring_slot  # the ring is needed as soon as one layer streams
        acc = 0
        while pinned < len(layers) and acc + layers[pinned] <= free:
            acc += layers[pinned]
            pinned += 1
        free -= acc
        ring_slots = 2
    slots = min(cap, min_slots + max(0, free) // needs.slot_bytes) if needs.slot_bytes else cap
    warnings = []
    if slots < needs.working_set and slots < cap:
        short = (needs.working_set - slots) * needs.slot_bytes
        warnings.append(
            f"the expert cache holds {slots} experts, fewer than the working set of {needs.working_set}"
            f" one forward pass uses, so LRU evicts nearly every expert before its layer comes round again"
            f" (hit rate near 0); add {_gb(short)} to --budget for the cache to start hitting"
        )
    return Plan(budget, needs, pinned, ring_slots, ring_slot if ring_slots else 0, slots, tuple(warnings))


def slot_bytes_for(expert_bytes: int, runs: int = 2) -> int:
    """Slot size for an expert in `runs` byte runs read with O_DIRECT aligned windows."""
    return (expert_bytes + runs * 2 * ALIGN + ALIGN - 1) // ALIGN * ALIGN


def state_bytes_for(cfg: ModelConfig, ctx: int) -> int:
    """float32 bytes of per-sequence state at `ctx` tokens: window ring, compressed rows, pending windows."""
    hd, ihd, w = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    total = 0
    for layer in range(cfg.n_layers):
        r = cfg.ratio(layer)
        total += w * hd * 4
        if r:
            coff = 2 if r == 4 else 1
            total += (ctx // r + 1) * hd * 4 + 2 * r * coff * hd * 4
        if r == 4:
            total += (ctx // r + 1) * ihd * 4 + 2 * r * 2 * ihd * 4
    return total


def staging_bytes_for(cfg: ModelConfig, chunk: int) -> int:
    """Scratch for one prefill chunk: hc streams, q/attention buffers, expert intermediates."""
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    per_tok = 4 * (3 * cfg.hc_mult * d + 3 * h * hd + 4 * cfg.moe_intermediate_size + cfg.vocab_size)
    return chunk * per_tok + 4 * cfg.vocab_size * 2


def needs_from_config(cfg: ModelConfig, ctx: int = 4096, chunk: int = DEFAULT_CHUNK) -> MemoryNeeds:
    """Estimate from config.json alone, with the release dtypes."""
    layer_bytes = tuple(
        sum(released_nbytes(cfg, s) for s in block_specs(cfg, i, with_experts=False)) for i in range(cfg.n_layers)
    )
    d, v, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    head = v * d * 2 + d * 2 + hc * hc * d * 4 + 4 * hc + 4
    head += cfg.tid2eid_bytes  # the hash layers' tables stay resident
    return MemoryNeeds(
        layer_bytes=layer_bytes,
        head_bytes=head,
        slot_bytes=slot_bytes_for(cfg.expert_bytes),
        state_bytes=state_bytes_for(cfg, ctx),
        staging_bytes=staging_bytes_for(cfg, chunk),
        working_set=cfg.working_set_experts,
        experts_per_token=cfg.num_experts_per_tok,
        total_experts=cfg.n_layers * cfg.n_routed_experts,
        unused=drafter_summary(cfg, drafter_nbytes(cfg)),
    )
