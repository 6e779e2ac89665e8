"""tools/llama_server_tests.py, the driver of llama.cpp's server tests, without llama.cpp: the
`dsv4 serve` options it derives from a llama ServerProcess, its reading of junit XML, and the
classification table (a failure no rule explains stays `ours?` and fails the run)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import llama_server_tests as h


def preset(**kw) -> SimpleNamespace:
    """The attributes of llama.cpp's ServerPreset.tinyllama2() that the driver reads."""
    base = {"server_host": "127.0.0.1", "server_port": 8080, "api_key": None, "n_ctx": 512, "n_slots": 2,
            "model_alias": "tinyllama-2", "cors_origins": None}  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_the_serve_options_follow_the_llama_preset() -> None:
    alias, *args = h._server_args(preset())
    assert alias == "tinyllama-2"
    opts = dict(zip(args[::2], args[1::2], strict=True))
    # llama.cpp splits n_ctx over its slots: a request gets n_ctx / n_slots
    assert opts == {"--host": "127.0.0.1", "--port": "8080", "--ctx": "256", "--cors-origin": "*"}
    _, *args = h._server_args(preset(api_key="sk-x", n_slots=None, server_port=8081, cors_origins="localhost"))
    opts = dict(zip(args[::2], args[1::2], strict=True))
    assert opts["--api-key"] == "sk-x" and opts["--ctx"] == "512" and opts["--port"] == "8081"
    assert opts["--cors-origin"] == "http://localhost,http://127.0.0.1,http://[::1]"
    # a different key, ctx or alias is another server; the same preset reuses the running one
    assert h._server_args(preset()) == h._server_args(preset())
    assert h._server_args(preset()) != h._server_args(preset(api_key="k"))


def test_the_alias_names_the_served_model(tmp_path: Path) -> None:
    ckpt = tmp_path / "tiny"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    cfg = {"checkpoint": str(ckpt), "work": str(tmp_path / "w")}
    named = h._checkpoint_named(cfg, "llama-test-model")
    assert named.name == "llama-test-model" and (named / "config.json").resolve() == (ckpt / "config.json")
    assert h._checkpoint_named(cfg, "") == ckpt


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="unit.test_basic" name="test_server_start_simple" time="1.0"/>
<testcase classname="unit.test_basic" name="test_server_props" time="1.0">
  <failure message="assert 404 == 200">trace</failure></testcase>
<testcase classname="unit.test_chat_completion" name="test_something_new" time="1.0">
  <failure message="assert 500 == 200">trace</failure></testcase>
<testcase classname="unit.test_tool_call" name="test_x" time="0.1"><skipped message="slow"/></testcase>
<testcase classname="unit.test_lora" name="test_lora[1]" time="0.1"><error message="">E   RuntimeError: x
E   TimeoutError: no health</error></testcase>
</testsuite></testsuites>"""


def test_junit_cases_are_classified_by_the_table(tmp_path: Path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text(JUNIT)
    cases = h.read_junit(xml)
    assert [c[:2] for c in cases] == [
        ("test_basic.py::test_server_start_simple", "passed"),
        ("test_basic.py::test_server_props", "failed"),
        ("test_chat_completion.py::test_something_new", "failed"),
        ("test_tool_call.py::test_x", "skipped"),
        ("test_lora.py::test_lora[1]", "error"),
    ]
    assert cases[4][2] == "E   TimeoutError: no health"  # an error without a message: its last line
    got = [h.classify(*c) for c in cases]
    assert [v.category for v in got] == ["pass", h.ROUTE, "ours?", "skipped", h.OPTION]
    text = h.report(got, 1.0)
    assert text.splitlines()[0] == "5 tests in 1 s: llama-only option 1, llama-only route 1, ours? 1, pass 1, skipped 1"
    assert "ours?" in text and "test_something_new" in text and "assert 500 == 200" in text


def test_every_rule_compiles_and_gives_a_reason() -> None:
    categories = {h.ROUTE, h.FIELD, h.OPTION, h.MODEL, h.DESIGN}
    for category, test_re, msg_re, reason in h.RULES:
        assert category in categories and reason, (test_re, reason)
        re.compile(test_re)
        re.compile(msg_re)
    # a module-wide rule never hides an OpenAI-route test of the chat module
    assert h.classify("test_chat_completion.py::test_brand_new", "failed", "x").category == "ours?"


def test_the_table_groups_the_failures_by_rule() -> None:
    got = [
        h.classify("test_tokenize.py::test_a", "failed", "x"),
        h.classify("test_tokenize.py::test_b", "failed", "x"),
        h.classify("test_basic.py::test_server_props", "failed", "x"),
        h.classify("test_basic.py::test_ok", "passed", ""),
    ]
    assert h.table(got).splitlines() == [
        "| llama-only route | 2 (tokenize) | /tokenize, /detokenize |",
        "| llama-only route | 1 (basic) | /props |",
    ]
