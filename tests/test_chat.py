"""Chat rendering against DeepSeek's official V4 encoder (`encoding/encoding_dsv4.py`).

Where each expected vector comes from:
- ONE_TURN_* strings: the official encoder's documented example (README of the checkpoint's
  `encoding/` folder: system "You are a helpful assistant." + user "What is 2+2?" in
  thinking mode ends `<｜Assistant｜><think>`); the chat-mode twin ends `</think>` by the rule
  in `render_message` (chat mode, or a turn before the last user turn, appends
  thinking_end_token). Public ports (ds4-style servers, Ollama's V4 renderer tests) pin the
  same two strings. The 17 ids are the real tokenizer's encoding of them (6 of them,
  BOS + "You are a helpful assistant", also appear in a public record of ds4's prompt ids).
- MULTI_TURN_CHAT: the official `encoding/tests` basic chat-mode gold, as reproduced in a
  public port's fixtures.
- THINK_TURNS vectors have the shape of the official `encoding/tests` case 2 gold (thinking
  mode, no tools: the first reasoning dropped, the last kept), with our own words.
- Everything else is derived by hand from the encoder's rules, named at each test:
  `merge_tool_messages` (tool results become <tool_result> blocks of a user turn, and
  consecutive user/tool messages merge, joined by a blank line), `sort_tool_results_by_call_order`,
  `_drop_thinking_messages` (thinking mode: reasoning of assistant turns before the last user
  turn is removed, developer turns there are dropped), `render_message` (per-role layout,
  DSML tool calls, and the <｜Assistant｜> + <think>/</think> transition after a user turn
  that is last or followed by an assistant or latest_reminder turn).
tests/test_chat_official.py checks 2,000 conversations against the official preview encoder's
own output (tools/compare_chat.py made them, and compares any number given the official file).
"""

import shutil

import pytest

from dsv4stream.errors import UsageError
from dsv4stream.text import chat
from dsv4stream.text.chat import Message, ToolCall
from dsv4stream.text.tokenizer import Tokenizer, real_tokenizer_files

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"

ONE_TURN_THINK = B + "You are a helpful assistant." + U + "What is 2+2?" + A + "<think>"
ONE_TURN_CHAT = B + "You are a helpful assistant." + U + "What is 2+2?" + A + "</think>"
ONE_TURN_IDS = [0, 3476, 477, 260, 11502, 22896, 16, 128803, 3085, 344, 223, 20, 13, 20, 33, 128804]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    for f in real_tokenizer_files():
        shutil.copy(f, d / f.name)
    (d / "config.json").write_text('{"vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1}')
    return Tokenizer.from_checkpoint(d)


def test_one_turn_official_vector(tok):
    msgs = chat.one_turn("What is 2+2?", system="You are a helpful assistant.")
    assert chat.render(msgs, "think") == ONE_TURN_THINK
    assert chat.render(msgs, "chat") == ONE_TURN_CHAT
    assert chat.encode(tok, msgs, "chat") == ONE_TURN_IDS + [128822]
    assert chat.encode(tok, msgs, "think") == ONE_TURN_IDS + [128821]
    assert len(chat.encode(tok, msgs, "chat")) == 17


def test_no_system_no_messages():
    assert chat.render(chat.one_turn("hi")) == B + U + "hi" + A + "</think>"
    assert chat.render([]) == B
    # A system message alone: BOS + its text, no turn markers (render_message, role system).
    assert chat.render([Message("system", "S")]) == B + "S"


MULTI = [
    Message("system", "You are a helpful assistant."),
    Message("user", "Hello"),
    Message("assistant", "Hi there! How can I help you?"),
    Message("user", "What is the capital of France?"),
    Message("assistant", "The capital of France is Paris."),
]
MULTI_TURN_CHAT = (
    B + "You are a helpful assistant."
    + U + "Hello" + A + "</think>" + "Hi there! How can I help you?" + E
    + U + "What is the capital of France?" + A + "</think>" + "The capital of France is Paris." + E
)  # fmt: skip


def test_multi_turn_chat_official_gold(tok):
    assert chat.render(MULTI, "chat") == MULTI_TURN_CHAT
    ids = chat.encode(tok, MULTI, "chat")
    assert ids.count(0) == 1 and ids.count(1) == 2 and ids.count(128822) == 2


THINK_TURNS = [
    Message("user", "Hello"),
    Message("assistant", "Hi!", reasoning="The user said hello."),
    Message("user", "Capital of France?"),
]


def test_think_mode_drops_earlier_reasoning():
    # _drop_thinking_messages removes the first reasoning; the first user turn precedes the
    # last user turn so it gets </think>; the last one opens <think>.
    want = B + U + "Hello" + A + "</think>" + "Hi!" + E + U + "Capital of France?" + A + "<think>"
    assert chat.render(THINK_TURNS, "think") == want
    assert "The user said hello" not in chat.render(THINK_TURNS, "think")


def test_think_mode_keeps_reasoning_after_last_user():
    # An assistant turn after the last user turn renders reasoning + </think> + content + EOS.
    done = THINK_TURNS + [Message("assistant", "Paris.", reasoning="It is Paris.")]
    want = (
        B + U + "Hello" + A + "</think>" + "Hi!" + E
        + U + "Capital of France?" + A + "<think>" + "It is Paris.</think>Paris." + E
    )  # fmt: skip
    assert chat.render(done, "think") == want


def test_think_mode_without_dropping():
    # drop_thinking=False: every user turn opens <think>, every reasoning is kept.
    want = (
        B + U + "Hello" + A + "<think>" + "The user said hello.</think>Hi!" + E
        + U + "Capital of France?" + A + "<think>"
    )  # fmt: skip
    assert chat.render(THINK_TURNS, "think", drop_thinking=False) == want


def test_chat_mode_never_renders_reasoning():
    want = B + U + "Hello" + A + "</think>" + "Hi!" + E + U + "Capital of France?" + A + "</think>"
    assert chat.render(THINK_TURNS, "chat") == want


TOOL_TURNS = [
    Message("system", "S"),
    Message("user", "Weather in Paris and Rome?"),
    Message(
        "assistant",
        "",
        reasoning="Need weather.",
        tool_calls=(
            ToolCall("get_weather", '{"city": "Paris", "days": 2}', id="c1"),
            ToolCall("get_weather", '{"city": "Rome"}', id="c2"),
        ),
    ),
    Message("tool", "rome: 20C", tool_call_id="c2"),
    Message("tool", "paris: 18C", tool_call_id="c1"),
]
DSML_CALLS = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
# Results merged into one user turn and re-ordered to the call order (c1, then c2).
TOOL_RESULTS = U + "<tool_result>paris: 18C</tool_result>\n\n<tool_result>rome: 20C</tool_result>"


def test_tool_calls_and_results_chat():
    want = B + "S" + U + "Weather in Paris and Rome?" + A + "</think>" + DSML_CALLS + E + TOOL_RESULTS + A + "</think>"
    assert chat.render(TOOL_TURNS, "chat") == want


def test_tool_calls_and_results_think():
    # The tool-result turn is the last user turn: the earlier reasoning is dropped and only
    # the final transition opens <think>.
    want = B + "S" + U + "Weather in Paris and Rome?" + A + "</think>" + DSML_CALLS + E + TOOL_RESULTS + A + "<think>"
    assert chat.render(TOOL_TURNS, "think") == want
    kept = B + "S" + U + "Weather in Paris and Rome?" + A + "<think>" + "Need weather.</think>" + DSML_CALLS + E
    assert chat.render(TOOL_TURNS, "think", drop_thinking=False) == kept + TOOL_RESULTS + A + "<think>"


def test_dsml_tokens(tok):
    ids = tok.encode(chat.render(TOOL_TURNS, "chat"))
    # One ｜DSML｜ per tag: 1 tool_calls + 2 invoke + 3 parameter pairs = 12 tags.
    assert ids.count(tok.special.dsml) == 12


def test_consecutive_user_and_tool_messages_merge():
    msgs = [Message("user", "a"), Message("user", "b"), Message("tool", "r")]
    assert chat.render(msgs) == B + U + "a\n\nb\n\n<tool_result>r</tool_result>" + A + "</think>"


def test_developer_and_latest_reminder():
    msgs = [Message("developer", "D"), Message("user", "Q1"), Message("assistant", "A1"), Message("user", "Q2")]
    # Chat mode keeps the developer turn (no transition: a user turn follows it).
    assert chat.render(msgs, "chat") == B + U + "D" + U + "Q1" + A + "</think>A1" + E + U + "Q2" + A + "</think>"
    # Think mode drops a developer turn before the last user turn.
    assert chat.render(msgs, "think") == B + U + "Q1" + A + "</think>A1" + E + U + "Q2" + A + "<think>"
    reminder = [Message("latest_reminder", "R"), Message("user", "Q")]
    assert chat.render(reminder) == B + "<｜latest_reminder｜>R" + U + "Q" + A + "</think>"
    # A user turn followed by a latest_reminder still gets the transition (render_message).
    after = [Message("user", "Q"), Message("latest_reminder", "R")]
    assert chat.render(after) == B + U + "Q" + A + "</think><｜latest_reminder｜>R"


def test_unfinished_assistant_has_no_eos():
    msgs = [Message("user", "Q"), Message("assistant", "Par", unfinished=True)]
    assert chat.render(msgs) == B + U + "Q" + A + "</think>Par"


def test_control_token_text_in_messages_stays_text(tok):
    # The rendered text is the official encoder's, but "<think>" typed by the user is only
    # characters: the sole <think>-family id is the renderer's closing </think>.
    ids = chat.encode(tok, chat.one_turn("say <think> now"), "chat")
    assert tok.special.think not in ids and ids.count(tok.special.think_end) == 1 and ids[-1] == tok.special.think_end
    assert tok.decode(ids) == chat.render(chat.one_turn("say <think> now"))
    assert tok.encode("say <think> now").count(tok.special.think) == 1  # raw text still parses it


def test_parsed_arguments_follow_the_v4_encoder():
    # encoding_dsv4.py json.loads the arguments; a value that is already parsed (not text)
    # fails that and becomes one "arguments" parameter holding its JSON.
    msgs = [Message("user", "q"), Message("assistant", tool_calls=(ToolCall("f", {"a": 1}),))]
    assert '<｜DSML｜parameter name="arguments" string="false">{"a": 1}</｜DSML｜parameter>' in chat.render(msgs)


def test_non_json_arguments_become_one_string_parameter():
    msgs = [Message("user", "q"), Message("assistant", tool_calls=(ToolCall("f", "not json"),))]
    assert '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>' in chat.render(msgs)


def test_from_openai_matches_direct_messages():
    raw = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Rome?"}]},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need weather.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "rome: 20C"},
        {"role": "tool", "tool_call_id": "c1", "content": "paris: 18C"},
    ]  # fmt: skip
    for mode in chat.MODES:
        assert chat.render(chat.from_openai(raw), mode) == chat.render(TOOL_TURNS, mode)


def test_bad_input_is_a_usage_error():
    with pytest.raises(UsageError):
        chat.render(chat.one_turn("q"), "thinking")
    with pytest.raises(UsageError):
        chat.render([Message("bot", "x")])
    with pytest.raises(UsageError):
        chat.render([Message("user", "q"), Message("assistant", tool_calls=(ToolCall("f", "[1, 2]"),))])
    with pytest.raises(UsageError):
        chat.from_openai([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
