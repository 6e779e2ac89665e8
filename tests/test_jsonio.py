"""The one JSON loader: size and depth limits, file types, and one-line errors for every reader."""

from __future__ import annotations

import json
import os
import threading

import pytest

from dsv4stream import jsonio
from dsv4stream.checkpoint.catalog import Catalog
from dsv4stream.errors import CheckpointError, ConfigError, Dsv4Error


def test_reads_a_document(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('{"a": [1, 2.5, "x", null, true], "b": 1e-20}')
    assert jsonio.read_json(p, "a doc") == {"a": [1, 2.5, "x", None, True], "b": 1e-20}


@pytest.mark.parametrize(
    "text, words",
    [
        ("[" * 2000 + "]" * 2000, "is not valid JSON"),  # past orjson's own limit: no RecursionError
        ("[" * 65 + "]" * 65, "nests deeper than 64 levels"),
        ('{"a": 1, "rms_norm_eps": NaN}', 'is not valid JSON at "rms_norm_eps"'),
        ('{"b": {"a" : -Infinity}}', 'is not valid JSON at "a"'),
        ('{"a": 1e999}', 'is not valid JSON at "a"'),
        ('{"a": [1, NaN]}', "is not valid JSON ("),
        ("{bad", "is not valid JSON"),
        ("", "is not valid JSON"),
    ],
)
def test_bad_documents_are_one_line(tmp_path, text, words):
    p = tmp_path / "a.json"
    p.write_text(text)
    msg = str(pytest.raises(ConfigError, jsonio.read_json, p, "config.json", ConfigError, fix="fix it").value)
    assert words in msg and msg.startswith(f"{p}: config.json") and msg.endswith("; fix it") and "\n" not in msg


def test_depth_is_counted_without_recursion():
    deep: list = []
    cur = deep
    for _ in range(100_000):  # deeper than the interpreter could recurse
        cur.append([])
        cur = cur[0]
    assert jsonio.nesting_depth(deep, 64) == 65
    assert jsonio.nesting_depth({"a": [{"b": 1}]}, 64) == 3 and jsonio.nesting_depth(5, 64) == 0


def test_size_is_refused_before_reading(tmp_path):
    p = tmp_path / "big.json"
    with open(p, "wb") as f:
        f.truncate(200 << 20)  # a sparse 200 MB file: refused on its size, never read
    msg = str(pytest.raises(Dsv4Error, jsonio.read_json, p, "the index", max_bytes=jsonio.INDEX_MAX).value)
    assert "209,715,200 bytes, more than the 67,108,864" in msg
    assert "more than the 10" in str(
        pytest.raises(Dsv4Error, jsonio.parse_json, b"[" + b" " * 20 + b"]", "x", max_bytes=10).value
    )


def test_a_fifo_is_named_and_never_opened(tmp_path):
    p = tmp_path / "config.json"
    os.mkfifo(p)
    done = []
    t = threading.Thread(
        target=lambda: done.append(pytest.raises(ConfigError, jsonio.read_json, p, "config.json", ConfigError))
    )
    t.start()
    t.join(10)
    assert done and "is a FIFO, not a regular file" in str(done[0].value)
    assert "is a directory" in str(pytest.raises(Dsv4Error, jsonio.read_json, tmp_path, "x").value)
    assert "x is missing" in str(pytest.raises(Dsv4Error, jsonio.read_json, tmp_path / "none.json", "x").value)


def test_checkpoint_readers_use_it(tiny_v41, tmp_path):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(tiny_v41, ck)
    index = ck / "model.safetensors.index.json"
    index.write_text('{"weight_map": ' + "[" * 100 + "]" * 100 + "}")
    msg = str(pytest.raises(CheckpointError, Catalog.open, ck).value)
    assert "the index nests deeper than 64 levels" in msg
    index.write_text(json.dumps({"weight_map": {"embed.weight": 3}}))
    assert "not a valid index file" in str(pytest.raises(CheckpointError, Catalog.open, ck).value)
