"""The server's JSON for tool calls and for a failure in the middle of a stream, checked
against the official `openai` and `anthropic` clients' own types and stream readers (the
model of the tests is random, so these are fed as fixed engine events)."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx2
import openai
import pytest
from anthropic.types.shared.error_response import ErrorResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import ResponseErrorEvent

from dsv4stream.errors import Dsv4Error
from dsv4stream.server import anthropic as anthropic_routes
from dsv4stream.server import responses as responses_routes
from dsv4stream.server.openai import chat_body, chat_chunks
from dsv4stream.server.reply import Delta, Outcome
from dsv4stream.server.toolkit import Events, Meta
from dsv4stream.server.worker import Job, Usage
from dsv4stream.text.chat import ToolCall
from dsv4stream.text.sampler import SamplingParams

CALLS = (ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("now", "{}"))


def test_non_streamed_tool_calls_parse_as_a_chat_completion() -> None:
    outcome = Outcome("tool_calls", "", reasoning="hm", content="Let me check.", tool_calls=CALLS)
    usage = Usage(prompt_tokens=30, cached_tokens=12, completion_tokens=9)
    body = ChatCompletion.model_validate(chat_body(Meta("chatcmpl", "m"), [outcome], True, usage))
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
        events = Events()
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
        return [s async for s in chat_chunks(job, events, Meta("chatcmpl", "m", include_usage=True), 5.0)]

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


# ---- an engine failure mid-stream, read by each API's official client ------------------------------


def _sse(stream) -> bytes:
    """The body a route's SSE generator writes for `job`'s events: started, one delta, then an error."""

    async def collect() -> bytes:
        out = [s async for s in stream()]
        return "".join(out).encode()

    return asyncio.run(collect())


def _failing_job() -> tuple[Job, Events]:
    events = Events()
    job = Job([1, 2], 8, SamplingParams(), None, events.emit)  # type: ignore[arg-type]
    for ev in (("started", (0, 2)), ("delta", Delta(content="Par")), ("error", Dsv4Error("trunk.bin changed on disk"))):
        events.emit(*ev)
    return job, events


def _transport(body: bytes) -> httpx2.Client:
    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return httpx2.Client(transport=httpx2.MockTransport(answer))


def test_an_anthropic_stream_ends_with_anthropics_error_event() -> None:
    def stream():
        job, events = _failing_job()
        return anthropic_routes._stream(job, events, Meta("msg", "m"), 5.0, 2)

    body = _sse(stream)
    client = anthropic.Anthropic(base_url="http://test", api_key="k", http_client=_transport(body), max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as e:
        for _ in client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                        stream=True):  # fmt: skip
            pass
    assert ErrorResponse.model_validate(e.value.body).error.type == "api_error"
    assert e.value.body["error"]["message"] == "trunk.bin changed on disk"
    assert b'"type": "error"' in body and b'{"error": {"message"' not in body  # not OpenAI's body


def test_a_responses_stream_ends_with_an_error_event_and_response_failed() -> None:
    def stream():
        job, events = _failing_job()
        meta = Meta("resp", "m")
        return responses_routes._stream(job, events, meta, {"id": meta.id}, 5.0, False, lambda _: None)

    client = openai.OpenAI(base_url="http://test/v1", api_key="k", http_client=_transport(_sse(stream)), max_retries=0)
    events = list(client.responses.create(model="m", input="hi", stream=True))
    error = next(e for e in events if e.type == "error")
    assert isinstance(error, ResponseErrorEvent) and error.message == "trunk.bin changed on disk"
    assert events[-1].type == "response.failed" and events[-1].response.error.message == error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_chat_stream_error_raises_in_the_openai_client() -> None:
    def stream():
        job, events = _failing_job()
        return chat_chunks(job, events, Meta("chatcmpl", "m"), 5.0)

    client = openai.OpenAI(base_url="http://test/v1", api_key="k", http_client=_transport(_sse(stream)), max_retries=0)
    with pytest.raises(openai.APIError, match="trunk.bin changed on disk"):
        for _ in client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True):
            pass
