"""The head's share of a plan: the BF16 head, or the int8 copy `fast` reads with the BF16 head on disk.

Owns the one rule `planner.plan` applies for every caller (`Runtime.open`, `dsv4 inspect` with
and without --config-only, `dsv4 doctor`, the benches), so that what they print is what the run
holds. `MemoryNeeds.head_q8_bytes` says the copy is offered (fast numerics on a CPU with the
copy's kernels, a pack holding it, the head not on a GPU); `head_mode` is what the plan took:

- BF16: no copy offered: the BF16 head resident, as always.
- INT8: the copy resident and the BF16 head left in its file, mapped read-only and not counted.
  Nothing of a run with the copy multiplies by the BF16 head: the main model's logits and the
  DSpark drafter's proposals (`kernels.head.head_logits`) both read the copy, and a head on a
  GPU has no copy. A normal step never touches the map; the NaN diagnosis (`model.scan`) reads
  through it. The copy holds half the bytes (V4-Flash: 0.53 GB for 1.06), so the plan with it
  has every slot and layer the plan without has, and more: the mode is taken wherever the copy
  is offered, at any budget.

Before the map, the copy sat beside the resident BF16 head, and where the budget was tight its
bytes came out of the expert slots: 4 real-dimension V4-Flash layers under a 2.6 GB limit,
--budget 2.2, decoded at 1.55 tok/s with the copy counted against the slots, 5.20 without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol, TypeVar

BF16, INT8 = "bf16", "int8"


class HeadNeeds(Protocol):
    """The fields of `planner.MemoryNeeds` this rule reads (planner imports this module)."""

    head_bytes: int
    head_q8_bytes: int
    head_matrix_bytes: int
    head_mode: str


N = TypeVar("N", bound=HeadNeeds)


def chosen(needs: N) -> N:
    """`needs` in the head mode the rule takes: INT8 where the copy is offered, else BF16."""
    return replace(needs, head_mode=INT8 if needs.head_q8_bytes else BF16)


def resident_bytes(needs: HeadNeeds) -> int:
    """The head's resident bytes in `needs.head_mode`: the BF16 head group (head, norm, hc_head,
    V4.1's hash tables), or that group with the copy in place of the BF16 matrix."""
    if needs.head_mode == INT8:
        return needs.head_bytes - needs.head_matrix_bytes + needs.head_q8_bytes
    return needs.head_bytes


def line(needs: HeadNeeds, gb: Callable[[int], str]) -> str:
    """The plan printout's words for the head (`Plan.lines`)."""
    if needs.head_mode == INT8:
        return (
            f"head {gb(resident_bytes(needs))} (its int8 copy {gb(needs.head_q8_bytes)} for fast's logits;"
            f" the BF16 head {gb(needs.head_matrix_bytes)} on disk, mapped, read only for a NaN diagnosis)"
        )
    return f"head {gb(needs.head_bytes)}"
