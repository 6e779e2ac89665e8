"""The V4.1 chat format, rule by rule, against strings written out by hand.

Where each expected string comes from: the official V4.1 encoder's documented examples
(`<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, ...)\\n\\nYou are a helpful
assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>`, and `...<｜User｜>hello<｜Assistant｜></think>`
in chat mode) and, for the rest, the rules its `encoding.py` states, named at each test:
`render_reasoning_effort`, the `<｜System｜>` placement in `render_message`, mid-conversation
system messages, `find_last_user_index` (tool-result-only turns do not count), the spaced DSML
tags of `tool_call_template`/`encode_arguments_to_dsml`, `merge_tool_messages` and
`sort_tool_results_by_call_order`, the response-format template, the refusals (unknown roles,
the image placeholder). tests/test_chat_official.py checks thousands of conversations against
the official encoder's own output.
"""

import json

import pytest

from dsv4stream.errors import UsageError
from dsv4stream.text import chat, dsml
from dsv4stream.text.chat import Message, ToolCall

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A, S = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>"


def effort(n: int) -> str:
    return f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def v41(msgs, mode="chat", **kw) -> str:
    return chat.render(msgs, mode, encoder="v41", **kw)


def test_the_documented_examples():
    msgs = chat.one_turn("What is 2+2?", system="You are a helpful assistant.")
    assert (
        v41(msgs, "think") == B + S + effort(75) + "You are a helpful assistant." + U + "What is 2+2?" + A + "<think>"
    )
    assert v41(msgs) == B + S + "You are a helpful assistant." + U + "What is 2+2?" + A + "</think>"
    assert v41(chat.one_turn("hello")) == B + U + "hello" + A + "</think>"
    # think mode without a system message: <｜System｜> still opens, for the effort line
    assert v41(chat.one_turn("hello"), "think") == B + S + effort(75) + U + "hello" + A + "<think>"


@pytest.mark.parametrize(
    ("given", "n"), [(None, 75), ("low", 50), ("high", 75), ("max", 100), (1, 1), (64, 64), (100, 100)]
)
def test_reasoning_effort_is_a_number_from_1_to_100(given, n):
    assert v41(chat.one_turn("q"), "think", effort=given) == B + S + effort(n) + U + "q" + A + "<think>"
    assert v41(chat.one_turn("q"), effort=given) == B + U + "q" + A + "</think>"  # chat mode: no effort line


@pytest.mark.parametrize("bad", [0, 101, -5, "medium", "75", True, 50.0])
def test_other_efforts_are_refused(bad):
    with pytest.raises(UsageError, match="1-100"):
        v41(chat.one_turn("q"), "think", effort=bad)


def test_effort_as_users_give_it():
    assert chat.parse_effort("60", "v41") == 60 and chat.parse_effort(" 7 ", "v41") == 7
    assert chat.parse_effort("max", "v41") == "max" and chat.parse_effort(None, "v41") is None
    for bad in ("0", "101", "medium", "1.5", ""):
        with pytest.raises(UsageError):
            chat.parse_effort(bad, "v41")
    with pytest.raises(UsageError, match="low, high, max"):
        chat.parse_effort("60", "0731")  # V4 names its levels
    assert chat.effort_choices("v41") == {
        "names": ["low", "high", "max"],
        "values": {"low": 50, "high": 75, "max": 100},
        "default": "high",
        "range": [1, 100],
    }
    assert (
        chat.effort_choices("0731")["names"] == ["low", "high", "max"]
        and chat.effort_choices("preview")["range"] is None
    )


def test_there_is_no_developer_role():
    with pytest.raises(UsageError) as e:
        v41([Message("developer", "be brief"), Message("user", "hi")])
    assert "\n" not in str(e.value) and "'developer'" in str(e.value) and "system message" in str(e.value)


def test_a_system_message_mid_conversation_asks_for_an_answer():
    msgs = [Message("user", "hi"), Message("assistant", "hello"), Message("system", "Now answer in French.")]
    assert v41(msgs) == B + U + "hi" + A + "</think>" + "hello" + E + S + "Now answer in French." + A + "</think>"
    # followed by a user turn, it is only the system text; a first system message never asks
    msgs = [Message("system", "s0"), Message("user", "u"), Message("system", "s1"), Message("user", "v")]
    assert v41(msgs) == B + S + "s0" + U + "u" + S + "s1" + U + "v" + A + "</think>"
    assert v41([Message("system", "alone")]) == B + S + "alone"


def test_old_reasoning_is_dropped_in_think_mode():
    msgs = [
        Message("user", "q1"),
        Message("assistant", "a1", reasoning="r1"),
        Message("user", "q2"),
        Message("assistant", "a2", reasoning="r2"),
    ]
    assert (
        v41(msgs, "think")
        == B + S + effort(75) + U + "q1" + A + "</think>" + "a1" + E + U + "q2" + A + "<think>" + "r2</think>a2" + E
    )
    # kept everywhere with drop_thinking=False (and whenever a message declares tools)
    kept = v41(msgs, "think", drop_thinking=False)
    assert "<think>r1</think>a1" in kept and "<think>r2</think>a2" in kept


def test_a_tool_loop_keeps_its_reasoning():
    # The turn holding only tool results is not a user turn (find_last_user_index), so the
    # assistant turn that called the tool keeps its reasoning and the next answer opens <think>.
    call = ToolCall("get_weather", '{"city": "Paris"}', id="c1")
    msgs = [
        Message("user", "weather?"),
        Message("assistant", "", reasoning="need a tool", tool_calls=(call,)),
        Message("tool", "18C", tool_call_id="c1"),
    ]
    want = (
        B + S + effort(75) + U + "weather?" + A + "<think>" + "need a tool</think>"
        + '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
        + '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        + "</｜DSML｜ invoke>\n</｜DSML｜ calls>" + E
        + U + "<tool_result>18C</tool_result>" + A + "<think>"
    )  # fmt: skip
    assert v41(msgs, "think") == want


def test_tool_calls_use_the_spaced_tags_and_json_values():
    call = ToolCall("f", {"a": 1, "b": "x", "c": {"d": [1, None]}})  # a parsed value, as some clients send
    twice = ToolCall("g", json.dumps(json.dumps({"k": True})))  # double-encoded JSON text
    text = ToolCall("h", "not json")
    out = v41([Message("user", "u"), Message("assistant", "ok", tool_calls=(call, twice, text))])
    assert out.endswith(
        'ok\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="a" string="false">1</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="b" string="true">x</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="c" string="false">{"d": [1, null]}</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
        '<｜DSML｜ invoke name="g">\n<｜DSML｜ parameter name="k" string="false">true</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
        '<｜DSML｜ invoke name="h">\n<｜DSML｜ parameter name="arguments" string="true">not json</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>" + E
    )
    with pytest.raises(UsageError, match="::"):
        v41([Message("user", "u"), Message("assistant", "", tool_calls=(ToolCall("a::b::c"),))])


def test_tool_results_merge_in_call_order():
    calls = (ToolCall("f", "{}", id="1"), ToolCall("g", "{}", id="2"))
    msgs = [
        Message("user", "u"),
        Message("assistant", "", tool_calls=calls),
        Message("tool", "from g", tool_call_id="2"),
        Message("tool", "from f", tool_call_id="1"),
        Message("user", "and?"),
    ]
    assert v41(msgs).endswith(
        U + "<tool_result>from f</tool_result>\n\n<tool_result>from g</tool_result>\n\nand?" + A + "</think>"
    )


def test_tools_and_response_format_on_a_system_message():
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    schema = {"type": "object", "properties": {"t": {"type": "number"}}}
    out = v41([Message("system", "Be brief.", tools=(weather,), response_format=schema), Message("user", "hi")])
    prompt = dsml.tools_prompt([weather["function"]], dsml.V41)
    rf = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n" + json.dumps(schema)
    assert out == B + S + "Be brief.\n\n" + prompt + "\n\n" + rf + U + "hi" + A + "</think>"
    assert '"<｜DSML｜ calls>" block' in prompt and '<｜DSML｜ invoke name="$TOOL_NAME">' in prompt


def test_content_parts_are_blocks_of_a_user_turn():
    msgs = chat.from_openai(
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert v41(msgs) == B + U + "a\n\nb" + A + "</think>"
    empty = chat.from_openai([{"role": "user", "content": []}, {"role": "user", "content": "x"}])
    assert v41(empty) == B + U + "x" + A + "</think>"  # no parts: no block, so no blank line


def test_the_image_placeholder_and_other_parts_are_refused():
    with pytest.raises(UsageError, match="image placeholder"):
        v41([Message("user", "see <｜deepseek_image｜> here")])
    with pytest.raises(UsageError, match="image placeholder"):
        v41([Message("user", "q"), Message("assistant", "a", reasoning="<｜deepseek_image｜>")])
    with pytest.raises(UsageError, match="only text"):
        chat.from_openai([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}])
    with pytest.raises(UsageError, match="not null"):
        chat.from_openai([{"role": "tool", "content": None}])


def test_unfinished_assistant_turn_has_no_eos():
    msgs = [Message("user", "u"), Message("assistant", "partial", unfinished=True)]
    assert v41(msgs) == B + U + "u" + A + "</think>partial"


def test_parse_reads_v41_calls_and_not_v4_ones():
    reply = 'Sure.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="n" string="false">3</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    got = dsml.parse_reply(reply, thinking=False, grammar=dsml.V41)
    assert got.content == "Sure." and got.tool_calls == (ToolCall("f", '{"n": 3}'),)
    assert dsml.parse_reply(reply, thinking=False, grammar=dsml.V4).tool_calls == ()
    v4_reply = reply.replace("｜DSML｜ calls", "｜DSML｜tool_calls").replace("｜DSML｜ ", "｜DSML｜")
    assert dsml.parse_reply(v4_reply, thinking=False, grammar=dsml.V4).tool_calls == got.tool_calls
    assert dsml.parse_reply(v4_reply, thinking=False, grammar=dsml.V41).tool_calls == ()
