"""Any argument value survives DSML (issue 40): a past call rendered into the prompt by either
release's encoder parses back to the same arguments, whatever its strings hold (the closing
parameter, invoke and block tags of both releases, quotes, backslashes, newlines, the JSON
escape text itself); and a model's JSON string that holds the closing tag's text unescaped
reads back whole. Property-style: many strings built from the pieces that could break it."""

from __future__ import annotations

import json
import random

import pytest

from dsv4stream.text import chat, dsml
from dsv4stream.text.chat import Message, ToolCall

PIECES = [
    *(
        t
        for g in (dsml.V4, dsml.V41)
        for t in (g.param_close, g.invoke_close, g.block_end, g.param_head, g.block_start)
    ),
    "</｜DSML｜",
    "<",
    ">",
    '"',
    '">',
    '" string="',
    'string="false">',
    "\\",
    "\\u003c",
    "\n",
    "\r\n",
    "\t",
    "｜",
    "DSML",
    "{}",
    "[1, 2]",
    "null",
    " ",
    "é中🙂",
    "\x00",
    "a",
    "text",
]


def _strings(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = ["", *PIECES]
    for _ in range(n):
        out.append("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 8))))
    return out


STRINGS = _strings(300, 40)


def _block(rendered: str, g: dsml.Grammar) -> str:
    """The text after the call block's start tag, through its end tag (strings come before it)."""
    at = rendered.index(g.block_start) + len(g.block_start)
    return rendered[at : rendered.rindex(g.block_end) + len(g.block_end)]


@pytest.mark.parametrize("encoder", ["0731", "v41"])
def test_rendered_calls_parse_back_whatever_their_strings_hold(encoder: str) -> None:
    g = chat.grammar(encoder)
    for s in STRINGS:
        args = {"raw": s, "nested": [s, {"k": s}], "n": 3}
        calls = (ToolCall("look", json.dumps(args, ensure_ascii=False)), ToolCall("now", "{}"))
        rendered = chat.render([Message("user", "x"), Message("assistant", "", tool_calls=calls)], encoder=encoder)
        got = dsml.parse_block(_block(rendered, g), g)
        assert [c.name for c in got] == ["look", "now"], repr(s)
        assert json.loads(got[0].arguments) == args, repr(s)


@pytest.mark.parametrize("g", [dsml.V4, dsml.V41], ids=["v4", "v41"])
def test_param_text_round_trips_and_never_holds_the_closing_tag(g: dsml.Grammar) -> None:
    for s in STRINGS:
        for value in (s, [s], {"k": s}):
            text, raw = dsml.param_text(value, g)
            assert g.param_close not in text, repr(value)
            assert (text if raw else json.loads(text)) == value, repr(value)
            assert raw == (isinstance(value, str) and g.param_close not in value)


@pytest.mark.parametrize("g", [dsml.V4, dsml.V41], ids=["v4", "v41"])
def test_a_json_string_holding_the_closing_tag_unescaped_reads_back(g: dsml.Grammar) -> None:
    for s in STRINGS:
        value = json.dumps(s, ensure_ascii=False)  # as a model may write it: the tag's '<' raw
        block = (
            f'\n{g.invoke_head}f">\n{g.param_head}a" string="false">{value}{g.param_close}\n'
            f'{g.param_head}b" string="true">after{g.param_close}\n{g.invoke_close}\n{g.block_end}'
        )
        (call,) = dsml.parse_block(block, g)
        assert json.loads(call.arguments) == {"a": s, "b": "after"}, repr(s)
