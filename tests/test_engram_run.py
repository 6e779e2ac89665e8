"""V4.1 runs read their Engram rows from disk: the same logits and ids as the in-memory
provider, the planned row cache, its figures in --stats-json and the report."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.cli.run import run as run_cmd
from dsv4stream.engine.session import Engine
from dsv4stream.run import planner
from dsv4stream.run.memory import measure
from dsv4stream.run.runinfo import RunOptions
from dsv4stream.run.runtime import Runtime
from dsv4stream.streaming.engram import DiskEngramRows
from dsv4stream.weights.providers import CatalogExperts, CatalogTrunk

PROMPT = [5, 17, 99, 5, 17, 200, 3]


@pytest.fixture(scope="module")
def budget(tiny_v41) -> int:
    """Room for twice the working set of experts, the whole trunk resident."""
    n = measure(tiny_v41, RunOptions(budget=1))
    return planner.budget_for(n, 2 * Catalog.open(tiny_v41).config.working_set_experts)


@pytest.fixture(scope="module")
def reference(tiny_v41):
    """Greedy ids and prefill logits with the in-memory Engram provider."""
    eng = Engine.open(tiny_v41)
    return list(eng.session().generate(PROMPT, 6)), eng.session(chunk_size=3).prefill(PROMPT)


def test_rows_from_disk_give_the_in_memory_providers_logits_and_ids(tiny_v41, reference):
    cat = Catalog.open(tiny_v41)
    # a cache smaller than one pass's rows: batches through the slots, evictions, read-ahead stops
    with DiskEngramRows(cat, capacity=cat.config.engram.columns + 3, warn=lambda m: None) as rows:
        eng = Engine(cat.config, CatalogTrunk(cat), CatalogExperts(cat), cat, engram_rows=rows)
        assert np.array_equal(eng.session(chunk_size=3).prefill(PROMPT), reference[1])
        assert list(eng.session().generate(PROMPT, 6)) == reference[0]
        s = rows.stats()
    assert s.evictions > 0 and s.rows_read > s.capacity


def test_a_v41_run_reads_engram_rows_into_the_planned_cache(tiny_v41, budget, reference):
    e = Catalog.open(tiny_v41).config.engram
    with Runtime.open(tiny_v41, RunOptions(budget=budget)) as rt:
        assert isinstance(rt.engine.stack.engram_rows, DiskEngramRows) and rt.engram is rt.engine.stack.engram_rows
        assert rt.plan.engram_rows > 0 and rt.engram.cache.capacity == max(rt.plan.engram_rows, e.columns)
        ids = list(rt.generate(rt.session(), PROMPT, 6))
        s = rt.stats()
    assert ids == reference[0]
    fed = len(PROMPT) + 5  # the prompt, then every generated token but the last
    assert s.engram_requests == fed * e.columns * len(e.layer_ids) == s.engram_hits + s.engram_misses
    assert 0 < s.engram_misses <= s.engram_rows_read and s.engram_bytes_read % 4096 == 0  # each miss was read
    assert s.engram_cache_rows == rt.engram.cache.capacity and s.engram_hit_rate == s.engram_hits / s.engram_requests
    assert s.peak_rss_bytes > 0


def test_stats_json_and_the_report_carry_the_engram_figures(tiny_v41, budget, tmp_path):
    out = tmp_path / "s.json"
    args = [str(tiny_v41), "--prompt-ids", ",".join(map(str, PROMPT)), "--gen", "4", "--greedy"]
    res = CliRunner().invoke(
        run_cmd, [*args, "--budget", f"{budget / 1e9:.9f}", "--stats", "--stats-json", str(out), "--verify"],
        catch_exceptions=False,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    s = json.loads(out.read_text())
    assert s["engram_requests"] > 0 and s["engram_rows_read"] > 0 and s["engram_cache_rows"] > 0
    assert "decode_engram_bytes_per_token" in s and "decode_expert_bytes_per_token" in s
    assert "Engram hit rate" in res.stderr and "of Engram per decode step" in res.stderr
    assert "engram: " in res.stderr  # the --stats summary
