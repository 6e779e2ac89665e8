"""The server's JSON for tool calls, checked against the official `openai` client's own
types (the model of the tests is random, so tool calls are fed as fixed engine events)."""

from __future__ import annotations

import asyncio
import json

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from dsv4stream.server.app import _Events, _Meta, chat_body, chat_chunks
from dsv4stream.server.reply import Delta, Outcome
from dsv4stream.server.worker import Job, Usage
from dsv4stream.text.chat import ToolCall
from dsv4stream.text.sampler import SamplingParams

CALLS = (ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("now", "{}"))


def test_non_streamed_tool_calls_parse_as_a_chat_completion() -> None:
    outcome = Outcome("tool_calls", "", reasoning="hm", content="Let me check.", tool_calls=CALLS)
    usage = Usage(prompt_tokens=30, cached_tokens=12, completion_tokens=9)
    body = ChatCompletion.model_validate(chat_body(_Meta("chatcmpl", "m"), [outcome], True, usage))
    msg = body.choices[0].message
    assert body.choices[0].finish_reason == "tool_calls" and msg.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
    ]
    assert len({c.id for c in msg.tool_calls}) == 2 and msg.model_extra["reasoning_content"] == "hm"
    assert body.usage.prompt_tokens_details.cached_tokens == 12 and body.usage.total_tokens == 39


def test_streamed_chunks_parse_and_carry_one_delta_per_call() -> None:
    async def collect() -> list[str]:
        events = _Events()
        job = Job([1, 2], 8, SamplingParams(), None, events.emit)  # type: ignore[arg-type]
        for ev in (
            ("progress", (2, 2)),
            ("delta", Delta(reasoning="why")),
            ("delta", Delta(content="Sure.")),
            ("delta", Delta(tool_calls=CALLS)),
            ("finish", Outcome("tool_calls", "", content="Sure.", tool_calls=CALLS)),
            ("done", [Outcome("tool_calls", "", content="Sure.", tool_calls=CALLS)]),
        ):
            events.emit(*ev)
        return [s async for s in chat_chunks(job, events, _Meta("chatcmpl", "m", include_usage=True), 5.0)]

    out = asyncio.run(collect())
    assert out[-1] == "data: [DONE]\n\n" and any(s.startswith(": prefill 2/2") for s in out)
    chunks = [ChatCompletionChunk.model_validate_json(s[6:]) for s in out if s.startswith("data: {")]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == [
        (0, "get_weather", '{"city": "Paris"}'),
        (1, "now", "{}"),
    ]
    assert "".join(d.content or "" for d in deltas) == "Sure."
    assert [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning_content")] == ["why"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 0
