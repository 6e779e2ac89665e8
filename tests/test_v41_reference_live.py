"""Live checks against DeepSeek's V4.1 reference (skipped unless DSV4_V41_REFERENCE names a local copy).

Unlike the stored fixtures these use layouts, seeds and vocabularies chosen now. Run with a
Python that has the `oracle-v41` extra (torch >= 2.9, sympy, pillow), e.g.
`DSV4_V41_REFERENCE=/work/ref/deepseek_v41 /work/refenv/bin/python -m pytest tests/test_v41_reference_live.py`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers

# isort: off
from v41_live import REFERENCE  # first: it skips this module without the reference
# isort: on

import torch

from dsv4stream.engram import HashLayout, next_row_ids, row_ids, token_classes
from dsv4stream.synth.v41 import small_tokenizer_json
from dsv4stream.text.tokenizer import real_tokenizer_files

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))

import make_v41_fixtures as mk
import v41_reference as vr

RELEASE_CONFIG = Path(__file__).resolve().parents[1] / "dsv4stream" / "v41_flash_config.json"


def test_release_config_reads_as_the_reference_config() -> None:
    # every text key of the shipped config.json, in the reference's names, equals its inference/config.json
    ours = vr.reference_config(json.loads(RELEASE_CONFIG.read_text()))
    theirs = json.loads((Path(REFERENCE) / "config.json").read_text())
    assert set(ours) <= set(theirs)
    assert ours == {k: theirs[k] for k in ours}


@pytest.mark.parametrize("seed", [101, 202, 303])
def test_engram_row_ids_match_the_reference_on_fresh_layouts(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_layers = int(rng.integers(1, 4))
    layer_ids = tuple(sorted(int(x) for x in rng.choice(40, n_layers, replace=False)))
    max_ngram, heads = int(rng.integers(2, 6)), int(rng.integers(1, 9))
    base = int(rng.choice([50, 997, 123_457, 16_000_000]))
    real = seed % 2 == 1
    path = real_tokenizer_files()[0] if real else None
    if not real:
        tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"v41tok-{seed}.json"
        tmp.write_text(small_tokenizer_json(int(rng.integers(80, 400)), seed))
        path = tmp
    tc = token_classes(tokenizers.Tokenizer.from_file(str(path)))
    tok = vr.HFTokenizer(path)
    seq = 200
    _, layout, state = mk.reference_engram(Path(REFERENCE), layer_ids, max_ngram, heads, base, tc.n_classes, tok, seq)
    ids = rng.integers(0, tc.n_ids, seq)
    ids[rng.random(seq) < 0.1] = 2
    with torch.inference_mode():
        want = state(torch.from_numpy(ids)[None], 0)[0].numpy()
    lay = HashLayout.build(layer_ids, max_ngram, heads, base, tc.n_classes, int(tc.classes[2]))
    assert [int(p) for g in layout.primes for q in g for p in q] == lay.primes.reshape(-1).tolist()
    got, _ = row_ids(lay, tc.of(ids))
    assert np.array_equal(got, want)
    hist, steps = (), []
    for c in tc.of(ids):
        r, hist = next_row_ids(lay, hist, int(c))
        steps.append(r)
    assert np.array_equal(np.stack(steps), want)
