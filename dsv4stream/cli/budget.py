"""`--budget` and checkpoint arguments of the commands: GB to bytes, the default, the warnings."""

from __future__ import annotations

import math

from ..errors import UsageError
from ..run import planner


def default_budget() -> int:
    """80% of the memory available now (what `--budget` defaults to)."""
    import psutil

    return int(psutil.virtual_memory().available * 0.8)


def budget_bytes(gb: float | None) -> int:
    """--budget GB (decimal) -> bytes; None -> the default."""
    if gb is None:
        return default_budget()
    if not (gb > 0 and math.isfinite(gb)):
        raise UsageError(f"--budget {gb}: give a positive, finite number of GB (decimal, e.g. --budget 3)")
    import psutil

    total = psutil.virtual_memory().total
    if gb * planner.GB > total:
        # the plan fills the budget with expert slots as the run goes: beyond physical memory
        # that ends with the kernel killing the run mid-answer, not with a message
        raise UsageError(
            f"--budget {gb:g} GB is above this machine's {total / planner.GB:.1f} GB of physical memory;"
            f" give at most {total / planner.GB:.1f} (the budget is what the process may hold in RAM)"
        )
    return int(gb * planner.GB)


def budget_warning(budget: int) -> str | None:
    """A budget above the memory available now fits the machine but may push it into swapping."""
    import psutil

    available = psutil.virtual_memory().available
    if budget <= available:
        return None
    return (
        f"--budget {budget / planner.GB:.2f} GB is above the {available / planner.GB:.2f} GB of memory available now;"
        " other programs may be swapped out, or this run killed, as the expert cache fills"
    )
