"""`dsv4 perplexity` and its math (`measure.perplexity`): the KL against a full-vocabulary
computation, exactly 0 for the same logits, a lower bound when the vocabulary is larger than the
record; the command on a tiny generated checkpoint (the real tokenizer), and its bad inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from dsv4stream.cli import main
from dsv4stream.measure import perplexity as ppl


def full_kl(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    la, lb = ppl.log_softmax(a), ppl.log_softmax(b)
    return np.sum(np.exp(la) * (la - lb), axis=1)


def test_kl_is_the_full_kl_when_the_record_holds_the_vocabulary_and_a_lower_bound_otherwise():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(50, 40)).astype(np.float32) * 3
    b = a + rng.normal(size=a.shape).astype(np.float32) * 0.3
    t = rng.integers(0, 40, 50)
    got = ppl.compare(ppl.record(a, t, k=40), b, t)
    np.testing.assert_allclose(got.kl, full_kl(a, b), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got.nll, -ppl.log_softmax(b)[np.arange(50), t])
    coarse = ppl.compare(ppl.record(a, t, k=5), b, t).kl
    assert (coarse <= full_kl(a, b) + 1e-12).all() and (coarse > 0).all()
    assert (got.same_top == (a.argmax(1) == b.argmax(1))).all()


def test_the_same_logits_give_kl_zero_exactly_and_full_agreement():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(30, 1000)).astype(np.float32)
    t = rng.integers(0, 1000, 30)
    rec = ppl.record(a, t)
    got = ppl.compare(rec, a.copy(), t)
    assert (got.kl == 0).all() and got.same_top.all()
    s = ppl.summary(rec, got)
    assert s["kl_mean"] == 0 and s["kl_p99"] == 0 and s["top1_agreement"] == 1.0
    assert s["perplexity"] == s["base_perplexity"] == pytest.approx(math.exp(np.mean(rec.nll)))


def run_ppl(ckpt: Path, text: Path, out: Path, *extra: str) -> dict:
    try:
        main(["perplexity", str(ckpt), "--text", str(text), "--ctx", "9", "--budget", "1", "--json", str(out), *extra])
    except SystemExit as e:  # main returns on success; a refusal exits 2
        assert e.code in (0, None), e.code
    return json.loads(out.read_text())


def test_perplexity_command_on_a_tiny_checkpoint(real_vocab_ckpt, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, twice over.", encoding="utf-8")
    same = run_ppl(real_vocab_ckpt, text, tmp_path / "same.json", "--numerics", "exact", "--kl-base", "fp32")
    assert same["windows"] >= 2 and same["positions"] == same["tokens"]  # every text token scored
    assert same["kl_mean"] == 0 and same["kl_max"] == 0 and same["top1_agreement"] == 1.0
    assert same["perplexity"] == same["base_perplexity"] and math.isfinite(same["perplexity"])
    fast = run_ppl(real_vocab_ckpt, text, tmp_path / "fast.json")  # default: fast against exact
    assert fast["numerics"].startswith("fast") and fast["kl_base"] == "exact"
    assert fast["base_perplexity"] == same["base_perplexity"]
    for k in ("perplexity", "kl_mean", "kl_p99", "kl_max", "top1_agreement"):
        assert math.isfinite(fast[k]), k
    assert 0 <= fast["kl_mean"] <= fast["kl_max"] < 0.1 and fast["top1_agreement"] >= 0.5


@pytest.mark.parametrize(
    "content, extra, words",
    [
        (None, (), ("--text", "no such file")),
        ("   \n", (), ("--text", "no text")),
        ("a", (), ("--text", "at least 2 tokens")),
        ("hello there world", ("--ctx", "1"), ("--ctx", "at least 2")),
        ("hello there world", ("--numerics", "bf16"), ("--numerics",)),
        (b"\xff\xfe bad", (), ("--text", "UTF-8")),
    ],
)
def test_perplexity_refuses_bad_input_in_one_line(real_vocab_ckpt, tmp_path, capsys, content, extra, words):
    text = tmp_path / "t.txt"
    if isinstance(content, bytes):
        text.write_bytes(content)
    elif content is not None:
        text.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        main(["perplexity", str(real_vocab_ckpt), "--text", str(text), *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and "Traceback" not in err, err
    assert all(w in err for w in words), err
