"""The server's side of V4.1's chat format: reasoning_effort mapped as the CLI maps it, tools on
a system message, and tool calls read back from V4.1's DSML, streamed token by token through
the real V4.1 tokenizer. (The model itself is not run: these are the prompt and the reply.)"""

import json

import pytest

from dsv4stream.errors import UsageError
from dsv4stream.server.prompt import chat_prompt
from dsv4stream.server.reply import ReplyStream
from dsv4stream.server.schemas import ChatRequest
from dsv4stream.text import chat, dsml
from dsv4stream.text.chat import Message, ToolCall
from dsv4stream.text.tokenizer import Tokenizer
from dsv4stream.text.vocab import write_tokenizer_files

MSGS = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
BLOCK = (
    '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Hang zhou</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("v41")
    write_tokenizer_files(d, "v41")
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "text_config": {"vocab_size": 129280}}))
    return Tokenizer.from_checkpoint(d)


def prompt_of(tok, **body):
    body = {"messages": MSGS, **body}
    return chat_prompt(tok, ChatRequest.model_validate(body), body, "v41")


@pytest.mark.parametrize(
    ("asked", "level"),
    [("low", 50), ("high", 75), ("max", 100), (1, 1), (60, 60), ("minimal", 75), ("medium", 75), ("xhigh", 100)],
)
def test_reasoning_effort_maps_to_v41_numbers(tok, asked, level):
    p = prompt_of(tok, reasoning_effort=asked)
    want = chat.encode(tok, [Message("user", "Hi")], "think", effort=level, encoder="v41")
    assert p.thinking and p.ids == want
    assert f"Reasoning Effort: {level} (range 1-100".encode() in tok.decode(p.ids).encode()


def test_reasoning_effort_out_of_range_is_refused(tok):
    for bad in (0, 101):
        with pytest.raises(UsageError, match="1-100"):
            prompt_of(tok, reasoning_effort=bad)
    body = {"messages": MSGS, "reasoning_effort": 60}
    with pytest.raises(UsageError, match="0731"):  # V4 names its levels
        chat_prompt(tok, ChatRequest.model_validate(body), body, "0731")


def test_thinking_off_means_no_effort_line(tok):
    p = prompt_of(tok, reasoning_effort="none")
    assert not p.thinking and p.ids == chat.encode(tok, [Message("user", "Hi")], "chat", encoder="v41")
    p = prompt_of(tok, thinking={"type": "disabled"}, reasoning_effort=80)
    assert "Reasoning Effort" not in tok.decode(p.ids)


def test_tools_go_on_the_system_message_and_calls_parse_as_v41(tok):
    p = prompt_of(tok, tools=[WEATHER])
    want = chat.encode(tok, [Message("system", tools=(WEATHER,)), Message("user", "Hi")], "chat", encoder="v41")
    assert p.tools and p.ids == want and p.grammar == dsml.V41
    body = {"messages": [{"role": "system", "content": "S"}, *MSGS], "tools": [WEATHER]}
    p2 = chat_prompt(tok, ChatRequest.model_validate(body), body, "v41")
    assert tok.decode(p2.ids).startswith("<｜begin▁of▁sentence｜><｜System｜>S\n\n## Tools")


@pytest.mark.parametrize("thinking", [False, True])
def test_v41_tool_calls_are_read_from_the_stream(tok, thinking):
    text = ("Let me check.</think>" if thinking else "") + "Looking it up." + BLOCK
    r = ReplyStream(tok, thinking=thinking, tools=True, grammar=dsml.V41)
    deltas = [r.push(t) for t in tok.encode(text)]
    last, outcome = r.finish("length")
    calls = (ToolCall("get_weather", '{"city": "Hang zhou", "days": 3}'),)
    assert outcome.tool_calls == calls and outcome.finish_reason == "tool_calls"
    assert "".join(d.content for d in [*deltas, last]) == "Looking it up."
    assert not any("DSML" in d.content for d in [*deltas, last])
    # a V4 stream reader sees V4.1's block as plain text
    v4 = ReplyStream(tok, thinking=thinking, tools=True)
    for t in tok.encode(text):
        v4.push(t)
    assert v4.finish("length")[1].tool_calls == ()


@pytest.mark.parametrize("encoder", ["v41", "0731"])
def test_a_json_schema_is_shown_to_the_model_as_the_encoders_do(tok, tmp_path, encoder):
    if encoder != "v41":
        write_tokenizer_files(tmp_path, "v4")
        (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 129280}))
        tok = Tokenizer.from_checkpoint(tmp_path)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "Pet", "schema": schema, "strict": True}}
    body = {"messages": [{"role": "system", "content": "S"}, *MSGS], "response_format": fmt, "tools": [WEATHER]}
    p = chat_prompt(tok, ChatRequest.model_validate(body), body, encoder)
    want = [Message("system", "S", tools=(WEATHER,), response_format=schema), Message("user", "Hi")]
    assert p.ids == chat.encode(tok, want, "chat", encoder=encoder)
    assert "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n" in tok.decode(p.ids)
    for other in ({"type": "json_object"}, {"type": "text"}):
        body = {"messages": MSGS, "response_format": other}
        plain = chat_prompt(tok, ChatRequest.model_validate(body), body, encoder)
        assert plain.ids == chat.encode(tok, [Message("user", "Hi")], "chat", encoder=encoder)


class Scripted:
    """A worker that answers every job with the same text (the model is not run): what the
    HTTP layer sends the engine and makes of its tokens, end to end."""

    queued = waiting = ahead = 0

    def __init__(self, tok, text):
        self.ids = [*tok.encode(text), tok.special.eos]
        self.jobs = []

    def submit(self, job):
        self.jobs.append(job)
        for t in self.ids:
            job.reply.push(t)
            if job.reply.stopped:
                break
        outcome = job.reply.finish("stop")[1]
        job.usage.prompt_tokens = len(job.ids)
        job.emit("done", [outcome])


def test_chat_completions_over_http_take_v41_efforts_and_answer_v41_tool_calls(tok):
    from fastapi.testclient import TestClient

    from dsv4stream.server.app import create_app
    from dsv4stream.server.toolkit import ServerState

    srv = ServerState("tiny-v41", tok, 4096, lambda line: None, encoder="v41")
    srv.worker = worker = Scripted(tok, "Checking.</think>Looking it up." + BLOCK)
    with TestClient(create_app(srv)) as client:
        for asked, level in ((30, 30), ("max", 100), (None, 75)):
            body = {"messages": MSGS, "tools": [WEATHER], "thinking": {"type": "enabled"}}
            if asked is not None:
                body["reasoning_effort"] = asked
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            want = [Message("system", tools=(WEATHER,)), Message("user", "Hi")]
            assert worker.jobs[-1].ids == chat.encode(tok, want, "think", effort=level, encoder="v41")
            msg = r.json()["choices"][0]["message"]
            assert msg["reasoning_content"] == "Checking." and msg["content"] == "Looking it up."
            call = msg["tool_calls"][0]["function"]
            assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Hang zhou", "days": 3}
            assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
        n = len(worker.jobs)
        for bad in (0, 101, "7x", 2.5):
            r = client.post("/v1/chat/completions", json={"messages": MSGS, "reasoning_effort": bad})
            assert r.status_code == 400 and "reasoning_effort" in r.json()["error"]["message"], (bad, r.text)
        assert len(worker.jobs) == n  # refused before the engine
