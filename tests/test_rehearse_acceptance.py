"""tools/rehearse_acceptance.py's pass/fail rules (the references it runs need torch: not here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="module")
def tool():
    path = Path(__file__).parents[1] / "tools" / "rehearse_acceptance.py"
    spec = importlib.util.spec_from_file_location("rehearse_acceptance", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _drafts(rng, p=6, b=5, v=40):
    ref = {"positions": np.arange(1, p + 1), "logits_fp32": rng.normal(0, 3, (p, b, v)).astype(np.float32)}
    ref["confidence_fp32"] = rng.uniform(0, 1, (p, b)).astype(np.float32)
    ref["logits_official"], ref["confidence_official"] = ref["logits_fp32"], ref["confidence_fp32"]
    ours = {"positions": ref["positions"][::-1].copy()}  # ours may list positions in another order
    ours["logits"], ours["confidence"] = ref["logits_fp32"][::-1].copy(), ref["confidence_fp32"][::-1].copy()
    return ours, ref


def test_draft_check_passes_equal_drafts_and_fails_moved_ones(tool) -> None:
    ours, ref = _drafts(np.random.default_rng(0))
    for against in ("fp32", "official"):  # both give the median row error the fast-vs-official rule compares
        r = tool.draft_check(ours, ref, against)
        assert r["ok"] and r["median"] == 0.0 and r["agree"] == 1.0
    scale = np.abs(ref["logits_fp32"]).max()
    ours["logits"] = ours["logits"] + 3e-4 * scale  # every row moved: exact's 1e-4 fails, official's 0.08 holds
    assert not tool.draft_check(ours, ref, "fp32")["ok"] and tool.draft_check(ours, ref, "official")["ok"]
    ours["logits"][:, :, 0] += 0.2 * scale
    assert not tool.draft_check(ours, ref, "official")["ok"]


def test_exact_figures_are_the_worst_position_and_the_clear_argmax(tool) -> None:
    ref = np.array([[0.0, 1.0, 2.0], [1.0, 1.00001, 0.0]], np.float32)  # row 1's top-2 is a near-tie
    got = ref.copy()
    got[1] = [1.0, 0.99999, 0.0]  # argmax flips on the tie only
    got[0, 0] = 0.002
    worst, agree = tool.exact_figures(got, ref)
    assert worst == pytest.approx(0.001) and agree == 1.0
    got[0] = [0.0, 2.1, 2.0]
    assert tool.exact_figures(got, ref)[1] == 0.0
