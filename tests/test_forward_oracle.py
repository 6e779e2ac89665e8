"""The forward pass against golden numbers from HF transformers (stored fixtures, no torch).

Each fixture in tests/fixtures/ is a release-format checkpoint plus transformers' logits
and intermediates for one token sequence (see tests/fixtures/README.md). Logits must agree
to 1e-4 of the position's largest logit with the same argmax, fed as one prefill, one
token at a time, or in chunks; the three modes must agree with each other to 1e-5.
Intermediates localise a failure to a layer and a block.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from dsv4stream.engine.session import Engine

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "oracle.npz").exists())
# mode -> (attention sub-chunk, prefill segment): "prefill" is the whole prompt at once,
# "step" one token per forward pass; the seg* modes run layer-major segments of 1, 7, 64
# tokens and "whole" the whole prompt as one segment in sub-chunks of 8.
MODES = {
    "prefill": (1 << 30, 1 << 30),
    "step": (1, 1),
    "chunk5": (5, 5),
    "chunk32": (32, 32),
    "seg1": (64, 1),
    "seg7": (4, 7),
    "seg64": (16, 64),
    "whole": (8, 1 << 30),
}
TOL = 1e-4  # vs transformers, relative to max |logit| at each position
SELF_TOL = 1e-5  # between feeding modes


@cache
def oracle(name: str) -> dict:
    with np.load(FIXTURES / name / "oracle.npz") as z:
        return {k: z[k] for k in z.files}


@cache
def engine(name: str) -> Engine:
    return Engine.open(FIXTURES / name)


@cache
def run(name: str, mode: str) -> tuple[np.ndarray, dict]:
    """Our logits and traced intermediates for a fixture in a feeding mode."""
    ids = oracle(name)["token_ids"]
    traces: dict = {"attn": {}, "ffn": {}, "hidden": {}, "index": {}, "route": {}}

    k = engine(name).cfg.index_topk

    def trace(what: str, layer: int, a: np.ndarray) -> None:
        if what == "input":  # the streams entering a layer (the drafter's taps): "hidden" of the one before
            return
        if what == "index":  # K = min(topk, rows so far) grows during the sequence
            a = np.pad(a, ((0, 0), (0, k - a.shape[1])), constant_values=-1)
        traces[what].setdefault(layer, []).append(a.copy())

    def on_route(layer: int, positions: np.ndarray, experts: np.ndarray) -> None:
        traces["route"].setdefault(layer, []).append(np.sort(experts, axis=1))

    chunk, segment = MODES[mode]
    s = engine(name).session(chunk_size=chunk, segment=segment, trace=trace, on_route=on_route)
    logits = s.prefill(ids)
    cat = {k: {i: np.concatenate(v) for i, v in d.items()} for k, d in traces.items()}
    return logits, cat


def rel_err(a: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per row: max |a - ref| / max |ref|."""
    a, ref = a.reshape(len(a), -1), ref.reshape(len(ref), -1)
    return np.abs(a - ref).max(axis=1) / np.abs(ref).max(axis=1)


def test_fixtures_present() -> None:
    assert set(NAMES) >= {"mixed", "ratio128", "f32scales", "dspark0731", "proshape"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name: str, mode: str) -> None:
    ref = oracle(name)["logits"]
    ours, _ = run(name, mode)
    assert ours.shape == ref.shape and ours.dtype == np.float32
    err = rel_err(ours, ref)
    assert err.max() <= TOL, f"{name}/{mode}: worst position {err.argmax()} rel err {err.max():.2e}"
    mismatch = np.flatnonzero(ours.argmax(1) != ref.argmax(1))
    assert mismatch.size == 0, f"{name}/{mode}: argmax differs at positions {mismatch[:10]}"


@pytest.mark.parametrize("mode", [m for m in MODES if m != "prefill"])
@pytest.mark.parametrize("name", NAMES)
def test_modes_agree(name: str, mode: str) -> None:
    a, _ = run(name, "prefill")
    b, _ = run(name, mode)
    err = rel_err(b, a)
    assert err.max() <= SELF_TOL, f"{name}: {mode} vs prefill rel err {err.max():.2e} at {err.argmax()}"


@pytest.mark.parametrize("name", NAMES)
def test_blocks_match_transformers(name: str) -> None:
    """Per layer, at probe positions: attention output, FFN output, streams after the layer."""
    o = oracle(name)
    _, tr = run(name, "prefill")
    probes = o["probes"]
    for what in ("attn", "ffn", "hidden"):
        for layer in range(o[what].shape[0]):
            err = rel_err(tr[what][layer][probes], o[what][layer])
            assert err.max() <= TOL, (
                f"{name}: {what} of layer {layer} at position {probes[err.argmax()]}: {err.max():.2e}"
            )


@pytest.mark.parametrize("mode", ["prefill", "step"])
@pytest.mark.parametrize("name", NAMES)
def test_choices_match_transformers(name: str, mode: str) -> None:
    """Router experts per token and layer; indexer rows per query at ratio-4 layers."""
    o = oracle(name)
    _, tr = run(name, mode)
    for key in (k for k in o if k.startswith("route_")):
        layer = int(key.split("_")[1])
        np.testing.assert_array_equal(tr["route"][layer], o[key], err_msg=f"{name}: experts of layer {layer}")
    for key in (k for k in o if k.startswith("index_")):
        layer = int(key.split("_")[1])
        ref = o[key]
        ours = tr["index"][layer]
        for t in range(len(ref)):
            want = set(ref[t][ref[t] >= 0].tolist())
            got = set(ours[t][ours[t] >= 0].tolist())
            assert got == want, (
                f"{name}: indexer rows of layer {layer} at position {t}: {sorted(got)} != {sorted(want)}"
            )


def test_fixture_coverage() -> None:
    """The fixtures exercise what they claim: every layer kind, long sequences, top-k < rows, the clamp."""
    kinds, hash_scored = set(), set()
    for name in NAMES:
        cfg = engine(name).cfg
        meta = json.loads((FIXTURES / name / "oracle.json").read_text())
        t = len(oracle(name)["token_ids"])
        for i in range(cfg.n_layers):
            r = cfg.ratio(i)
            kinds.add("window" if r == 0 else "csa" if r == 4 else f"hca{r}")
            hash_scored.add(cfg.is_hash_layer(i))
            if r:
                assert t // r >= 2, f"{name}: layer {i} sees fewer than two compression periods"
            if r == 4:
                assert t // 4 > cfg.index_topk, f"{name}: index_topk never binds"
        assert t > cfg.sliding_window
        assert meta["checks"]["gate_over"] > 0 and meta["checks"]["up_over"] > 0
    assert {"window", "csa", "hca128"} <= kinds and any(k.startswith("hca") and k != "hca128" for k in kinds)
    assert hash_scored == {True, False}
