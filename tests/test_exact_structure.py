"""bench/exact_structure.py --measure: the weight bytes a decode step reads, counted per role,
against the bytes the checkpoint's tensors say a token must read (an independent sum)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from dsv4stream.checkpoint.catalog import Catalog


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).parents[1] / "bench" / "exact_structure.py"
    spec = importlib.util.spec_from_file_location("exact_structure", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_measure_counts_a_tokens_expert_and_head_bytes(bench, tiny_v4) -> None:
    cfg = json.loads((tiny_v4 / "config.json").read_text())
    m = bench.measure(
        tiny_v4, "fast", budget=1.0, gen=4, threads=(1, 2), prompt=[0, 5, 9], rate_bytes=1 << 24, streams=(1, 2)
    )
    cat = Catalog.open(tiny_v4)
    # every routed expert has the same three tensors: a token reads top-k of them per layer
    expert = sum(e.nbytes for n, e in cat.entries.items() if n.startswith("layers.0.ffn.experts.0."))
    want_experts = cfg["num_experts_per_tok"] * cfg["num_hidden_layers"] * expert
    assert m["numerics"].startswith("fast") and set(m["by_threads"]) == {1, 2}
    for t, r in m["by_threads"].items():
        assert r["threads"] == t and r["read_rate"]["threads"] == t
        assert r["bytes_per_token"]["experts"] == want_experts
        assert r["bytes_per_token"]["head"] == cat.entries["head.weight"].nbytes
        assert r["steps"] == 3 and len(r["ids"]) == 4 and r["expert_reads_in_window"] == 0
        for name in ("trunk+head", "experts"):
            x = r[name]
            assert x["ms"] > 0 and x["cpu_ms"] > 0 and np.isfinite(x["ratio"] + x["cpu_ratio"])
        assert r["read_rate"]["wall_gbps"] > 0 and r["read_rate"]["cpu_gbps"] > 0
    assert m["by_threads"][1]["ids"] == m["by_threads"][2]["ids"]  # ids never depend on threads
    assert "numerics fast" in bench.measure_lines(m)


def test_reduced_checkpoints_keep_real_dimensions(bench) -> None:
    from dsv4stream.synth import release_config

    v4 = release_config("flash", **{k: v for k, v in bench.reduced("flash", 4, 16).items() if k != "sparse_experts"})
    assert v4["num_hidden_layers"] == 4 and v4["compress_ratios"] == [0, 4, 128, 4, 0]
    assert v4["hidden_size"] == 4096 and v4["moe_intermediate_size"] == 2048 and v4["n_routed_experts"] == 16
    o = bench.reduced("flash-v41", 5, 16)
    assert o["sparse_experts"] is False and o["num_hidden_layers"] == 5 and o["dspark_n_routed_experts"] == 8
    assert bench.reduced("flash", None, None) == {}
    with pytest.raises(SystemExit):
        bench.reduced("flash", 4, None)
