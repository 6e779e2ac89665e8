"""Helpers the engine tests share (test_engine_invariants.py, test_prefill.py): a budget giving a
number of expert slots and pinned trunk layers, and a count of the store's reads from disk."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from dsv4stream.run import planner
from dsv4stream.run.memory import measure
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.store import ExpertStore


def streaming(ckpt: Path, slots: int, pinned: int, **kw) -> RunOptions:
    """Run options whose budget plans `slots` expert slots and `pinned` trunk layers (overhead 0, chunk 4)."""
    n = measure(ckpt, RunOptions(budget=1, overhead=0, chunk=4, **kw))
    return RunOptions(budget=planner.budget_for(n, slots, pinned), overhead=0, chunk=4, **kw)


def count_expert_reads(monkeypatch) -> Counter:
    """Reads from disk per (layer, expert) key, counted as the store loads them."""
    reads: Counter = Counter()
    real = ExpertStore._load

    def counting(self, entry):
        reads[entry.key] += 1
        return real(self, entry)

    monkeypatch.setattr(ExpertStore, "_load", counting)
    return reads
