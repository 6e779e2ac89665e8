"""The head's share of a plan: the BF16 head, the int8 copy `fast` reads, and which stay resident.

Owns the one rule `planner.plan` applies for every caller (`Runtime.open`, `dsv4 inspect` with
and without --config-only, `dsv4 doctor`, the benches), so that what they print is what the run
holds. `MemoryNeeds.head_q8_bytes` says the copy is offered (fast numerics on a CPU with the
copy's kernels, a pack holding it, the head not on a GPU); `head_mode` is what the plan chose:

- BF16: no copy offered, or one declined (below): the BF16 head resident, as always.
- INT8: the copy resident and the BF16 head left in its file, mapped read-only and not
  counted, where nothing else in the run reads it (no drafter: --speculate off or a checkpoint
  without one). A normal step never touches the map; the NaN diagnosis (`model.scan`) reads
  through it. Always taken where offered: it holds half the bytes (V4-Flash: 0.53 GB for 1.06),
  so the plan with it has every slot and layer the plan without has, and more.
- BOTH: the copy resident beside the BF16 head, which the drafter proposes with. Taken only
  where the copy's bytes are budget nothing else would use (the plan without the copy keeps
  its expert slots, pinned trunk layers and Engram rows): each slot lost is a disk read on
  some later token, which costs far more than the copy saves on the head's read (4
  real-dimension V4-Flash layers under a 2.6 GB limit, --budget 2.2: decode 1.55 tok/s with
  the copy counted against the slots, 5.20 tok/s without the copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol, TypeVar

from ..errors import BudgetError

BF16, INT8, BOTH = "bf16", "int8", "both"
DRAFTER = "the drafter"  # `MemoryNeeds.head_reader` of a run that drafts


class HeadNeeds(Protocol):
    """The fields of `planner.MemoryNeeds` this rule reads (planner imports this module)."""

    head_bytes: int
    head_q8_bytes: int
    head_matrix_bytes: int
    head_reader: str
    head_mode: str
    total_experts: int


class HeadPlan(Protocol):
    """The fields of `planner.Plan` the rule compares."""

    expert_slots: int
    pinned_layers: int
    engram_rows: int


N = TypeVar("N", bound=HeadNeeds)
P = TypeVar("P", bound=HeadPlan)


def choices(needs: N) -> tuple[N, ...]:
    """The head modes this run may take, preferred first, as needs to plan (one or two)."""
    bf16 = replace(needs, head_mode=BF16)
    if not needs.head_q8_bytes:
        return (bf16,)
    if not needs.head_reader:
        return (replace(needs, head_mode=INT8),)
    return replace(needs, head_mode=BOTH), bf16


def smallest(needs: N) -> N:
    """The mode holding the fewest head bytes (what the smallest budget is measured with)."""
    return choices(needs)[-1]


def choose(needs: N, budget: int, plan_one: Callable[[N, int], P]) -> P:
    """The plan of `budget` with the head mode this module's rule picks (BudgetError as `plan_one`)."""
    modes = choices(needs)
    base = plan_one(modes[-1], budget)
    if len(modes) == 1:
        return base
    try:
        both = plan_one(modes[0], budget)
    except BudgetError:
        return base
    keeps = (
        both.expert_slots >= min(base.expert_slots, needs.total_experts)
        and both.pinned_layers >= base.pinned_layers
        and both.engram_rows >= base.engram_rows
    )
    return both if keeps else base


def resident_bytes(needs: HeadNeeds) -> int:
    """The head's resident bytes in `needs.head_mode`: the BF16 head group (head, norm, hc_head,
    V4.1's hash tables), plus the copy, less the BF16 matrix where it stays on disk."""
    n = needs.head_bytes
    if needs.head_mode in (INT8, BOTH):
        n += needs.head_q8_bytes
    if needs.head_mode == INT8:
        n -= needs.head_matrix_bytes
    return n


def line(needs: HeadNeeds, gb: Callable[[int], str]) -> str:
    """The plan printout's words for the head (`Plan.lines`)."""
    n, q8 = needs, needs.head_q8_bytes
    if n.head_mode == INT8:
        return (
            f"head {gb(resident_bytes(n))} (its int8 copy {gb(q8)} for fast's logits; the BF16 head"
            f" {gb(n.head_matrix_bytes)} on disk, mapped, read only for a NaN diagnosis)"
        )
    if n.head_mode == BOTH:
        return f"head {gb(n.head_bytes)} + its int8 copy {gb(q8)} (fast logits; {n.head_reader} reads the BF16 head)"
    if q8:
        return (
            f"head {gb(n.head_bytes)} (its int8 copy {gb(q8)} not used: beside the BF16 head {n.head_reader}"
            " reads, at this --budget it would take expert slots or trunk layers; a larger --budget uses it)"
        )
    return f"head {gb(n.head_bytes)}"
