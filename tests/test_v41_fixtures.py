"""What the DeepSeek-V4.1 reference fixtures hold, checked without the forward pass.

The fixtures (tests/fixtures/v41/<name>, tools/make_v41_fixtures.py) must exercise what they
claim: the indexer and the candidate blocks really select, the two index-key modes and the two
numerics really differ, and the reference's fp32 run agrees with itself between prefill and
decode. Their Engram row ids, hashed by DeepSeek's engram.py from the checkpoint's own
tokenizer.json and config, must be ours.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from dsv4stream.engram import HashLayout, check_class_count, row_ids, token_classes

FIXTURES = Path(__file__).parent / "fixtures" / "v41"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "oracle.npz").exists())


@cache
def oracle(name: str) -> dict:
    with np.load(FIXTURES / name / "oracle.npz") as z:
        return {k: z[k] for k in z.files}


def text_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())["text_config"]


def rel_err(a: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.abs(a - ref).max(axis=1) / np.abs(ref).max(axis=1)


def test_the_fixtures_are_there() -> None:
    assert {"plan", "wide", "clamp"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_engram_rows_of_the_fixture_are_ours(name: str) -> None:
    t = text_config(name)
    tc = token_classes(tokenizers.Tokenizer.from_file(str(FIXTURES / name / "tokenizer.json")))
    check_class_count(tc, t["engram_compressed_vocab_size"])
    assert tc.n_classes < tc.n_ids  # the class map is not the identity
    lay = HashLayout.build(
        t["engram_layer_ids"],
        t["engram_max_ngram_size"],
        t["engram_n_heads"],
        t["engram_vocab_size"],
        tc.n_classes,
        int(tc.classes[t["engram_pad_token_id"]]),
    )
    lay.check_table_rows(t["engram_num_embeddings"])
    rows, _ = row_ids(lay, tc.of(oracle(name)["token_ids"]))
    assert np.array_equal(rows, oracle(name)["engram_rows"])


@pytest.mark.parametrize("name", NAMES)
def test_the_indexer_and_the_candidate_blocks_select(name: str) -> None:
    t, n = text_config(name), oracle(name)["token_ids"].size
    ratios = t["compress_ratios"][: t["num_hidden_layers"]]
    for layer in t["index_source_layer_ids"]:
        assert n // ratios[layer] > 2 * t["index_topk"], f"layer {layer} sees too few compressed rows to select"
    cand = t["candidate_source_layer_id"]
    blocks = -(-(n // ratios[cand]) // t["candidate_block_size"])
    assert blocks > 2 * t["candidate_topk_blocks"]
    # a pool smaller than index_topk would let non-candidate rows in at -inf ties
    assert (t["candidate_topk_blocks"] - 1) * t["candidate_block_size"] + 1 >= t["index_topk"]
    assert t["sliding_window"] < n // 4 and t["engram_layer_ids"]


@pytest.mark.parametrize("name", NAMES)
def test_the_reference_runs_tell_the_modes_apart(name: str) -> None:
    o = oracle(name)
    # fp32: the reference's prefill and its decode (owner keys) agree to float rounding ...
    assert rel_err(o["step_fp32_owner"], o["prefill_fp32"]).max() < 1e-5
    # ... so the 1e-4 fp32 tolerance separates the shipped decode from the owner-key one,
    assert rel_err(o["step_fp32_asshipped"], o["step_fp32_owner"]).max() > 1e-2
    # and the official numerics from fp32
    assert rel_err(o["prefill_official"], o["prefill_fp32"]).max() > 1e-2
    assert o["prefill_fp32"].shape == (o["token_ids"].size, text_config(name)["vocab_size"])


@pytest.mark.parametrize("name", NAMES)
def test_recorded_gaps_and_self_differences_match_the_arrays(name: str) -> None:
    o = oracle(name)
    meta = json.loads((FIXTURES / name / "oracle.json").read_text())
    s = np.sort(o["prefill_fp32"], axis=1)
    gap = (s[:, -1] - s[:, -2]) / np.abs(o["prefill_fp32"]).max(axis=1)
    assert np.allclose(gap, o["gap_prefill_fp32"])
    d = meta["reference_self_differences"]["official: step (owner keys) vs prefill"]
    e = rel_err(o["step_official_owner"], o["prefill_official"])
    assert d["median_rel_err"] == pytest.approx(float(np.median(e)), rel=1e-6)
    assert min(meta["fp32_min_boundary_gaps"].values()) >= 1e-5
