"""PNG plots of budget sweeps: hit rate and decode s/token against the cache size.

Owns the figure only; the numbers come in as records (one dict per budget, or per budget
and policy) from `dsv4 bench` or `dsv4 bench simulate`. matplotlib is imported here and
only here, with the file-only Agg backend, so nothing needs a display.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import UsageError
from ..files import AtomicFile

X_LABELS = {"budget_gb": "--budget (GB)", "slots": "expert cache (experts)"}
# One look per policy, so that lines that coincide (pinned and Belady often do) stay visible:
# different dashes and hollow markers of different sizes show through each other.
STYLES = {
    "lru": {"linestyle": "-", "marker": "o", "markersize": 7},
    "pinned": {"linestyle": "--", "marker": "s", "markersize": 11, "markerfacecolor": "none", "linewidth": 2.5},
    "pinned+lru": {"linestyle": "-.", "marker": "^", "markersize": 8},
    "belady": {"linestyle": ":", "marker": "D", "markersize": 5, "linewidth": 1.5},
}


def plot_sweep(
    records: Sequence[Mapping],
    path: str | os.PathLike,
    *,
    x: str = "budget_gb",
    threshold: float | None = None,
    title: str | None = None,
) -> Path:
    """Write a PNG: hit rate (top) and, when the records have ``decode_s_per_token``, s/token
    (bottom) against ``records[i][x]``. One line per ``policy`` when records carry one.
    ``threshold``: where the cache starts holding one pass's working set, drawn as a
    vertical line (in units of ``x``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise UsageError("plots need matplotlib: pip install 'dsv4stream[bench]'") from e
    if not records:
        raise UsageError("nothing to plot: the sweep produced no records")
    timed = [r for r in records if r.get("decode_s_per_token") is not None]
    fig, axes = plt.subplots(2 if timed else 1, 1, figsize=(7, 6.5 if timed else 4), sharex=True, squeeze=False)
    ax_hit = axes[0][0]
    for policy, rows in _by_policy(records).items():
        rows = sorted(rows, key=lambda r: r[x])
        style = STYLES.get(policy or "", {"marker": "o"})
        ax_hit.plot(
            [r[x] for r in rows],
            [100 * r["hit_rate"] for r in rows],
            label=policy or "hit rate",
            clip_on=False,  # a marker at 0% or 100% is drawn whole, not cut by the frame
            **style,
        )
    ax_hit.set_ylabel("expert cache hit rate (%)")
    ax_hit.set_ylim(0, 100)
    ax_hit.grid(True, alpha=0.3)
    if timed:
        ax_t = axes[1][0]
        rows = sorted(timed, key=lambda r: r[x])
        ax_t.plot(
            [r[x] for r in rows], [r["decode_s_per_token"] for r in rows], marker="s", color="tab:red", clip_on=False
        )
        ax_t.set_ylabel("decode s/token")
        ax_t.set_ylim(bottom=0)
        ax_t.grid(True, alpha=0.3)
    for row in axes:
        if threshold is not None:
            row[0].axvline(threshold, color="gray", linestyle="--", label="working set fits")
    axes[-1][0].set_xlabel(X_LABELS.get(x, x))
    ax_hit.legend(loc="upper left", fontsize="small")
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    out = Path(path)
    with AtomicFile(out, "wb") as f:
        fig.savefig(f.file, dpi=110, format=out.suffix.lstrip(".").lower() or "png")
    plt.close(fig)
    return out


def _by_policy(records: Sequence[Mapping]) -> dict[str | None, list[Mapping]]:
    groups: dict[str | None, list[Mapping]] = {}
    for r in records:
        groups.setdefault(r.get("policy"), []).append(r)
    return groups
