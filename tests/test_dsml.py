"""DSML tool calls: the tools prompt as the official encoder writes it, parsing fixed model
outputs into calls (whole and streamed token by token through the real tokenizer),
malformed blocks returned as text, reasoning split at </think>, and stop strings."""

from __future__ import annotations

import json

import pytest

from dsv4stream.server.reply import ReplyStream
from dsv4stream.text import chat, dsml
from dsv4stream.text.chat import Message, ToolCall
from dsv4stream.text.tokenizer import Tokenizer, real_tokenizer_files

D = "｜DSML｜"
WEATHER = {
    "name": "get_weather",
    "description": "Get current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}

# Written out by hand from the official encoding_dsv4.py's template (not built by our code).
EXPECTED_TOOLS_SECTION = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by"
    ' writing a "<｜DSML｜tool_calls>" block like the following:\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke'
    ' name="$TOOL_NAME">\n<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    '</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n<｜DSML｜invoke name="$TOOL_NAME2">\n...\n</｜DSML｜invoke>\n'
    '</｜DSML｜tool_calls>\n\nString parameters should be specified as is and set `string="true"`. For all other'
    ' types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside"
    " <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output directly after </think>"
    " with tool calls or final response.\n\n### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Get current weather for a city.", "parameters": {"type": "object",'
    ' "properties": {"city": {"type": "string"}}, "required": ["city"]}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)

BLOCK = (
    f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Hang zhou'
    f'</{D}parameter>\n<{D}parameter name="days" string="false">3</{D}parameter>\n</{D}invoke>\n'
    f'<{D}invoke name="now">\n\n</{D}invoke>\n</{D}tool_calls>'
)
CALLS = (ToolCall("get_weather", '{"city": "Hang zhou", "days": 3}'), ToolCall("now", "{}"))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    import tokenizers

    from dsv4stream.text.tokenizer import SPECIAL_TEXT, SpecialTokens

    path = real_tokenizer_files()[0]
    hf = tokenizers.Tokenizer.from_file(str(path))
    special = SpecialTokens(**{k: hf.token_to_id(v) for k, v in SPECIAL_TEXT.items()})
    n = max(hf.get_vocab(with_added_tokens=True).values()) + 1
    return Tokenizer(hf, special, vocab_size=129280, n_tokens=n, fingerprint="", model_max_length=0)


def test_tools_prompt_is_the_official_text() -> None:
    assert dsml.tools_prompt([WEATHER]) == EXPECTED_TOOLS_SECTION
    text = chat.render([Message("system", dsml.with_tools("Be brief.", [WEATHER])), Message("user", "Hi")])
    assert text == f"<｜begin▁of▁sentence｜>Be brief.\n\n{EXPECTED_TOOLS_SECTION}<｜User｜>Hi<｜Assistant｜></think>"


def test_parse_inverts_the_rendered_calls() -> None:
    rendered = chat.render([Message("user", "x"), Message("assistant", "Let me look.", tool_calls=CALLS)])
    reply = rendered.split("<｜Assistant｜></think>", 1)[1].removesuffix("<｜end▁of▁sentence｜>")
    assert reply == "Let me look." + BLOCK
    got = dsml.parse_reply(reply, thinking=False)
    assert got.content == "Let me look." and got.tool_calls == CALLS
    assert json.loads(got.tool_calls[0].arguments) == {"city": "Hang zhou", "days": 3}


@pytest.mark.parametrize(
    "bad",
    [
        BLOCK.replace(f"</{D}tool_calls>", ""),  # never closed
        BLOCK.replace('string="false">3', 'string="false">three'),  # not JSON
        BLOCK.replace('string="true"', 'string="yes"'),
        BLOCK.replace('name="days"', 'name="city"'),  # a parameter twice
        BLOCK + "trailing",
        BLOCK.replace(f'<{D}invoke name="now">', f"<{D}invoke>"),
        f"\n\n<{D}tool_calls>\n</{D}tool_calls>",  # no calls
    ],
)
def test_malformed_blocks_stay_text(bad: str) -> None:
    got = dsml.parse_reply("Hi" + bad, thinking=False)
    assert got.tool_calls == () and got.content == "Hi" + bad


def _stream(tok: Tokenizer, text: str, **kw) -> tuple[list, object]:
    r = ReplyStream(tok, **kw)
    deltas = [r.push(t) for t in tok.encode(text)]
    last, outcome = r.finish("length")
    return [*deltas, last], outcome


@pytest.mark.parametrize(
    "text,thinking",
    [
        ("I think so.</think>Answer: yes." + BLOCK, True),
        ("Plain answer with a newline\n\nand more.", False),
        ("Half a block\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=", False),
        ("Reasoning that never ends", True),
        ("中文的回答，带表情😀" + BLOCK, False),
    ],
)
def test_streamed_deltas_add_up_to_the_whole_parse(tok, text: str, thinking: bool) -> None:
    deltas, outcome = _stream(tok, text, thinking=thinking, tools=True)
    whole = dsml.parse_reply(text, thinking=thinking)
    assert "".join(d.reasoning for d in deltas) == whole.reasoning == outcome.reasoning
    assert "".join(d.content for d in deltas) == whole.content == outcome.content
    assert tuple(c for d in deltas for c in d.tool_calls) == whole.tool_calls == outcome.tool_calls
    assert outcome.finish_reason == ("tool_calls" if whole.tool_calls else "length")
    # no delta ever carries the block's markup
    assert not any(D in d.content for d in deltas) or not whole.tool_calls


def test_without_tools_a_block_is_plain_text(tok) -> None:
    deltas, outcome = _stream(tok, "x" + BLOCK, thinking=False, tools=False)
    assert "".join(d.content for d in deltas) == "x" + BLOCK
    assert outcome.content == "x" + BLOCK and outcome.tool_calls == () and outcome.finish_reason == "length"


def test_stop_strings_cut_the_text_and_end_the_reply(tok) -> None:
    r = ReplyStream(tok, thinking=False, tools=False, stops=["STOP", "never"])
    out = ""
    for t in tok.encode("one two STOP three"):
        out += r.push(t).content
        if r.stopped:
            break
    last, outcome = r.finish("length")
    out += last.content
    assert r.stopped and out == "one two " == outcome.content and outcome.finish_reason == "stop"


def test_eos_is_not_text(tok) -> None:
    r = ReplyStream(tok, thinking=False, tools=False)
    assert not r.push(tok.special.eos)
    _, outcome = r.finish("stop")
    assert outcome.content == "" and outcome.finish_reason == "stop"
