"""bench/vs_llamacpp.py's agreement check: the bytes it expects llama-simple to print for ids.

llama.cpp is not run here; what is checked is the half that is ours: that a generated id
sequence becomes the bytes llama-simple prints (byte-level pieces mapped back to raw bytes,
special tokens as their text, nothing from EOS on), on the real V4 tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from dsv4stream.text.tokenizer import Tokenizer, real_tokenizer_files


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).parents[1] / "bench" / "vs_llamacpp.py"
    spec = importlib.util.spec_from_file_location("vs_llamacpp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    ck = tmp_path_factory.mktemp("ck")
    for src in real_tokenizer_files():
        shutil.copy(src, ck / src.name)
    cfg = {"model_type": "deepseek_v4", "vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1}
    (ck / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return Tokenizer.from_checkpoint(ck)


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        " memorandum职业技能 remodelingデータVertex应有的ѣ",
        "tab\tnewline\n\n é ß 😀",
    ],
)
def test_pieces_join_to_the_texts_utf8_bytes(bench, tok, text) -> None:
    ids = tok.encode(text)
    assert len(ids) > 3
    kept, got = bench.printed(tok, ids)
    assert kept == ids
    assert got == text.encode()


def test_special_tokens_print_as_their_text_and_eos_ends_the_output(bench, tok) -> None:
    bos, eos = tok.special.bos, tok.special.eos
    ids = tok.encode(tok.token_text(bos) + "Hello world")
    assert ids[0] == bos
    assert bench.printed(tok, ids)[1] == "<｜begin▁of▁sentence｜>Hello world".encode()
    tail = tok.encode(" after")
    kept, got = bench.printed(tok, [*tok.encode(" one two"), eos, *tail])
    assert kept == tok.encode(" one two")
    assert got == b" one two"


def test_agreeing_counts_the_leading_tokens_printed_alike(bench, tok) -> None:
    """--check-agree's count: tokens whose pieces llama.cpp printed the same, up to the first that
    differs (random weights: a near-tie flips one token and every later one differs)."""
    ids = tok.encode(" memorandum职业技能 remodeling")
    assert len(ids) >= 3
    assert bench.agreeing(tok, bench.printed(tok, ids)[1], ids) == len(ids)
    theirs = bench.printed(tok, ids[:2])[1] + b" Bobby"
    assert bench.agreeing(tok, theirs, ids) == 2
    assert bench.agreeing(tok, b"", ids) == 0
