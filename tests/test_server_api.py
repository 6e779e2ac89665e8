"""What the official clients ask of `dsv4 serve` beyond plain chat: structured output that
parses whatever the weights (openai's `parse`, LangChain's `with_structured_output`, streamed
and not), log-probabilities, n choices, logit_bias and penalties, parallel_tool_calls, the
Responses API, Anthropic's count_tokens / stop_sequence / usage / text-only tool results,
and /metrics. A real server on 127.0.0.1 over the random-weight test checkpoint."""

from __future__ import annotations

import http.client
import json
import math
from collections import Counter
from pathlib import Path

import anthropic
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel
from server_proc import Server

from dsv4stream import synth
from dsv4stream.server.decoding import Controls, adjust
from dsv4stream.server.reply import ReplyStream
from dsv4stream.server.responses import input_messages
from dsv4stream.text.tokenizer import Tokenizer

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


class Pet(BaseModel):
    name: str
    legs: int
    tags: list[str]
    vaccinated: bool


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("api") / "tiny"
    return synth.make_checkpoint(out, preset="tiny", seed=11, vocab_size=synth.REAL_VOCAB, tokenizer=True)


@pytest.fixture(scope="module")
def server(ckpt):
    with Server(ckpt, "--ctx", "512") as s:
        yield s


@pytest.fixture(scope="module")
def tok(ckpt) -> Tokenizer:
    return Tokenizer.from_checkpoint(ckpt)


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


def greedy(srv: Server, **kw):
    return client(srv).chat.completions.create(model="tiny", messages=MSGS, temperature=0, **{"max_tokens": 6, **kw})


# ---- structured output ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_parse_returns_a_validating_object_whatever_the_weights(server, seed) -> None:
    r = client(server).chat.completions.parse(
        model="tiny", messages=MSGS, response_format=Pet, max_tokens=48, temperature=1.0, seed=seed
    )
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 48


def test_parse_streamed(server) -> None:
    with client(server).chat.completions.stream(
        model="tiny", messages=MSGS, response_format=Pet, max_tokens=40, temperature=0
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Pet)


def test_json_object_parses(server) -> None:
    r = greedy(server, max_tokens=24, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_schema_llguidance_refuses_is_400(server) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense-type"}}}
    with pytest.raises(openai.BadRequestError):
        greedy(server, response_format=bad)


def test_langchain_with_structured_output(server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="tiny", max_tokens=40, temperature=0,
                     max_retries=0, timeout=300)  # fmt: skip
    structured = llm.with_structured_output(Pet)
    assert isinstance(structured.invoke("Describe a pet."), Pet)
    last = None
    for last in structured.stream("Describe a pet."):
        pass
    assert isinstance(last, Pet)


# ---- logprobs, n, bias, penalties ------------------------------------------------------------------


def test_logprobs_in_the_openai_shape_streamed_and_not(server) -> None:
    r = greedy(server, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert 1 <= len(content) <= r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert item.logprob == item.top_logprobs[0].logprob  # greedy: the top one was chosen
        assert sum(math.exp(t.logprob) for t in item.top_logprobs) <= 1 + 1e-9
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token
    assert b"".join(bytes(i.bytes) for i in content).decode() == r.choices[0].message.content
    chunks = list(greedy(server, logprobs=True, top_logprobs=3, stream=True))
    streamed = [i for c in chunks if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in content]
    assert greedy(server).choices[0].logprobs is None


def test_legacy_completion_logprobs(server) -> None:
    c = client(server)
    r = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x", max_tokens=1, logprobs=6)


def test_n_choices_share_the_prompt(server) -> None:
    one = greedy(server).choices[0].message.content
    r = greedy(server, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content == one for c in r.choices)
    sampled = client(server).chat.completions.create(model="t", messages=MSGS, max_tokens=6, temperature=1, seed=5, n=3)
    texts = [c.message.content for c in sampled.choices]
    solo = client(server).chat.completions.create(model="t", messages=MSGS, max_tokens=6, temperature=1, seed=5)
    assert texts[0] == solo.choices[0].message.content and len(set(texts)) > 1
    assert sampled.usage.prompt_tokens == solo.usage.prompt_tokens
    chunks = list(greedy(server, n=2, stream=True))
    per = Counter(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert per == {0: 1, 1: 1}
    text = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
            for i in (0, 1)}  # fmt: skip
    assert text == {0: one, 1: one}


def test_logit_bias_forces_and_forbids_a_token(server, tok) -> None:
    x = tok.encode(" banana")[0]
    r = greedy(server, logit_bias={str(x): 100})
    assert r.choices[0].message.content == tok.decode([x] * r.usage.completion_tokens)
    first = tok.encode(greedy(server).choices[0].message.content)[0]
    banned = greedy(server, logit_bias={str(first): -100}).choices[0].message.content
    assert not banned or tok.encode(banned)[0] != first
    with pytest.raises(openai.BadRequestError):
        greedy(server, logit_bias={"not-an-id": 1})
    with pytest.raises(openai.BadRequestError):
        greedy(server, logit_bias={str(x): 101})


def test_penalties_follow_openais_formula() -> None:
    logits = np.arange(8, dtype=np.float32)
    got = adjust(logits, Controls(bias={1: 3.0}, frequency=0.5, presence=0.25), Counter({7: 2, 1: 1}))
    want = logits.astype(np.float64)
    want[1] += 3.0 - 0.5 - 0.25
    want[7] -= 2 * 0.5 + 0.25
    assert np.array_equal(got, want)
    assert adjust(logits, Controls(), Counter({7: 2})) is logits


def test_penalties_change_the_greedy_answer(server, tok) -> None:
    """The two likeliest first tokens, both lifted far above the rest: greedy then picks between
    them by the model's logits alone, and with penalties each use counts against a token."""
    top = greedy(server, max_tokens=1, logprobs=True, top_logprobs=2).choices[0].logprobs.content[0].top_logprobs
    pair = [tok.encode(bytes(t.bytes).decode())[0] for t in top]
    bias = {str(i): 100 for i in pair}
    plain = tok.encode(greedy(server, max_tokens=16, logit_bias=bias).choices[0].message.content)
    assert set(plain) <= set(pair)
    penalised = greedy(server, max_tokens=16, logit_bias=bias, frequency_penalty=2.0, presence_penalty=2.0)
    ids = tok.encode(penalised.choices[0].message.content)
    assert set(ids) <= set(pair) and ids != plain
    assert max(Counter(ids).values()) - min(Counter(ids).values()) <= 2  # penalties keep the two in balance


def test_parallel_tool_calls_false_keeps_one_call(tok) -> None:
    d = "｜DSML｜"
    block = (f'\n\n<{d}tool_calls>\n<{d}invoke name="a">\n</{d}invoke>\n<{d}invoke name="b">\n</{d}invoke>\n'
             f"</{d}tool_calls>")  # fmt: skip
    for parallel, names in ((True, ["a", "b"]), (False, ["a"])):
        reply = ReplyStream(tok, thinking=False, tools=True, parallel=parallel)
        for t in tok.encode(block):
            reply.push(t)
        assert [c.name for c in reply.finish("stop")[1].tool_calls] == names


# ---- Responses API ----------------------------------------------------------------------------------


def test_responses_text_streaming_and_previous_response_id(server) -> None:
    c = client(server)
    r = c.responses.create(model="tiny", input="Hello there", instructions="Be brief.", max_output_tokens=5,
                           temperature=0)  # fmt: skip
    assert r.status in ("completed", "incomplete") and r.output_text and r.usage.output_tokens <= 5
    assert r.id.startswith("resp_")  # OpenAI's own form (clients and tests check it)
    events = list(c.responses.create(model="tiny", input="Hello there", instructions="Be brief.", max_output_tokens=5,
                                     temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    final = events[-1].response  # response.completed, or response.incomplete at max_output_tokens (as OpenAI's)
    assert final.output_text == r.output_text and final.status == r.status
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    nxt = c.responses.create(model="tiny", input="And more?", previous_response_id=r.id, max_output_tokens=3,
                             instructions="Be brief.", temperature=0)  # fmt: skip
    assert nxt.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="tiny", input="x", previous_response_id="resp_nope", max_output_tokens=1)


def test_responses_tools_reasoning_and_format(server) -> None:
    c = client(server)
    tool = {"type": "function", "name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip
    plain = c.responses.create(model="t", input="Weather in Paris?", max_output_tokens=1, temperature=0)
    tooled = c.responses.create(model="t", input="Weather in Paris?", tools=[tool], max_output_tokens=1, temperature=0)
    assert tooled.usage.input_tokens > plain.usage.input_tokens + 20
    thought = c.responses.create(model="t", input="Think.", reasoning={"effort": "high"}, max_output_tokens=4)
    assert thought.output[0].type == "reasoning" and thought.usage.output_tokens_details.reasoning_tokens > 0
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "flag", "schema": schema, "strict": True}}
    shaped = c.responses.create(model="t", input="Answer.", text=fmt, max_output_tokens=12)
    assert isinstance(json.loads(shaped.output_text)["ok"], bool)
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model="t", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])


def test_responses_logprobs_and_encrypted_reasoning_when_included(server) -> None:
    c = client(server)
    include = ["message.output_text.logprobs", "reasoning.encrypted_content"]
    kw = {"model": "t", "input": "Hi.", "max_output_tokens": 5, "temperature": 0, "include": include, "top_logprobs": 2}
    r = c.responses.create(**kw)
    part = r.output[-1].content[0]
    assert len(part.logprobs) >= 1 and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert b"".join(bytes(lp.bytes) for lp in part.logprobs).decode(errors="replace") == part.text
    deltas = [e for e in c.responses.create(**kw, stream=True) if e.type == "response.output_text.delta"]
    assert [lp.token for e in deltas for lp in e.logprobs] == [lp.token for lp in part.logprobs]
    thought = c.responses.create(**{**kw, "input": "Think.", "reasoning": {"effort": "high", "summary": "auto"}})
    item = thought.output[0]
    assert item.type == "reasoning" and item.encrypted_content
    back = input_messages([item.model_dump(exclude_none=True), {"role": "assistant", "content": "ok"}])
    assert back == [{"role": "assistant", "content": "ok", "reasoning_content": item.content[0].text}]


# ---- Anthropic ------------------------------------------------------------------------------------------


def anthropic_client(srv: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=300)


def test_anthropic_count_tokens_stop_sequence_and_text_only_tool_results(server, tok) -> None:
    a = anthropic_client(server)
    msgs = [{"role": "user", "content": "Name three colours."}]
    counted = a.messages.count_tokens(model="tiny", system="You are terse.", messages=msgs)
    r = a.messages.create(
        model="tiny", system="You are terse.", messages=msgs, max_tokens=8, extra_body={"temperature": 0}
    )
    assert counted.input_tokens == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    assert r.id.startswith("msg_")
    text = "".join(b.text for b in r.content if b.type == "text")
    pieces = [tok.decode([t]) for t in tok.encode(text)]
    stop = next(p for p in pieces[1:] if p.strip())
    cut = a.messages.create(model="tiny", system="You are terse.", messages=msgs, max_tokens=8, extra_body={"temperature": 0},
                            stop_sequences=["never there", stop])  # fmt: skip
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    tool_turns = [
        {"role": "user", "content": "Look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "see", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}]},
    ]
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model="tiny", messages=tool_turns, max_tokens=2)
    assert "text only" in e.value.body["error"]["message"]


def test_anthropic_stream_usage_is_the_same_at_open_and_close(server) -> None:
    msgs = [{"role": "user", "content": "Count to three."}]
    for _ in range(2):  # the second turn reads the first's prompt from the prefix cache
        body = {"messages": msgs, "max_tokens": 4, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request("POST", "/v1/messages", json.dumps(body).encode(), {"Content-Type": "application/json"})
        lines = [ln.decode().strip() for ln in conn.getresponse()]
        conn.close()
        data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
        start = next(d for d in data if d["type"] == "message_start")["message"]["usage"]
        end = next(d for d in data if d["type"] == "message_delta")["usage"]
        assert start["input_tokens"] == end["input_tokens"]
        assert start["cache_read_input_tokens"] == end["cache_read_input_tokens"]
        said = "".join(d["delta"].get("text", "") for d in data if d["type"] == "content_block_delta")
        msgs = [*msgs, {"role": "assistant", "content": said}, {"role": "user", "content": "Go on."}]
    assert end["cache_read_input_tokens"] > 0


def test_anthropic_thinking_budget_output_format_and_effort(server) -> None:
    a = anthropic_client(server)
    msgs = [{"role": "user", "content": "Think, then answer."}]
    free = a.messages.create(model="tiny", messages=msgs, max_tokens=12, thinking={"type": "adaptive"},
                             output_config={"effort": "high"}, extra_body={"temperature": 0})  # fmt: skip
    r = a.messages.create(model="tiny", messages=msgs, max_tokens=12, thinking={"type": "enabled", "budget_tokens": 3},
                          output_config={"effort": "high"}, extra_body={"temperature": 0})  # fmt: skip
    # greedy: the same first three reasoning tokens, then </think> where the free reply went on reasoning
    assert [b.type for b in free.content] == ["thinking"] and r.content[0].type == "thinking"
    assert free.content[0].thinking.startswith(r.content[0].thinking)
    assert len(r.content[0].thinking) < len(free.content[0].thinking)
    assert r.usage.output_tokens > 4  # the answer went on after the reasoning
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    shaped = a.messages.create(
        model="tiny", messages=msgs, max_tokens=16, output_config={"format": {"type": "json_schema", "schema": schema}}
    )
    assert isinstance(json.loads(shaped.content[0].text)["n"], int)


def test_a_chat_stream_opens_with_the_role_and_null_content(server) -> None:
    """llama.cpp's tests (and its stream helper) read the opening chunk's content as null, as
    OpenAI sends it before a tool call; every later content delta is non-empty text."""
    c = client(server)
    chunks = list(c.chat.completions.create(model="t", messages=MSGS, max_tokens=4, stream=True, n=2))
    for i in (0, 1):
        first = next(ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i)
        assert first.delta.role == "assistant" and first.delta.content is None
    later = [ch.choices[0].delta for ch in chunks if ch.choices and ch.choices[0].delta.role is None]
    assert all(d.content is None or d.content != "" for d in later)


def test_an_anthropic_thinking_block_streams_its_signature_before_it_closes(server) -> None:
    """Anthropic's stream ends a thinking block with a `signature_delta` (llama.cpp's
    test_compat_anthropic checks it; clients replaying thinking blocks read it)."""
    a = anthropic_client(server)
    msgs = [{"role": "user", "content": "Think, then answer."}]
    events = list(a.messages.create(model="tiny", messages=msgs, max_tokens=8, stream=True, extra_body={"temperature": 0},
                                    thinking={"type": "enabled", "budget_tokens": 2}))  # fmt: skip
    kinds = [(e.type, getattr(e, "index", None), getattr(getattr(e, "delta", None), "type", None)) for e in events]
    start = next(e for e in events if e.type == "content_block_start" and e.content_block.type == "thinking")
    mine = [k for k in kinds if k[1] == start.index]
    assert mine[-2:] == [
        ("content_block_delta", start.index, "signature_delta"),
        ("content_block_stop", start.index, None),
    ]
    assert [k[2] for k in mine].count("signature_delta") == 1


class Lookup(BaseModel):
    city: str
    days: int


def test_strict_tool_calls_validate_with_the_official_clients_streamed_and_not(server) -> None:
    c = client(server)
    tool = openai.pydantic_function_tool(Lookup)
    kw = {"model": "t", "messages": [{"role": "user", "content": "Weather?"}], "tools": [tool], "max_tokens": 150,
          "tool_choice": "required"}  # fmt: skip
    got = c.chat.completions.parse(**kw).choices[0]
    assert got.finish_reason == "tool_calls" and got.message.tool_calls[0].function.name == "Lookup"
    assert isinstance(got.message.tool_calls[0].function.parsed_arguments, Lookup)
    with c.chat.completions.stream(**kw, parallel_tool_calls=False) as stream:
        final = stream.get_final_completion().choices[0]
    assert [isinstance(t.function.parsed_arguments, Lookup) for t in final.message.tool_calls] == [True]
    schema = tool["function"]["parameters"]
    rt = {"type": "function", "name": "lookup", "parameters": schema, "strict": True}
    resp = c.responses.create(model="t", input="Weather?", tools=[rt], tool_choice={"type": "function", "name": "lookup"},
                              max_output_tokens=150)  # fmt: skip
    (call,) = [o for o in resp.output if o.type == "function_call"]
    assert call.name == "lookup" and Lookup.model_validate_json(call.arguments)
    msg = anthropic_client(server).messages.create(
        model="tiny", max_tokens=150, messages=[{"role": "user", "content": "Weather?"}],
        tools=[{"name": "lookup", "input_schema": schema, "strict": True}], tool_choice={"type": "any"},
    )  # fmt: skip
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and Lookup.model_validate(use.input)


# ---- /metrics -------------------------------------------------------------------------------------------


def test_metrics_in_prometheus_format(server) -> None:
    greedy(server, max_tokens=2)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    text = r.read().decode()
    assert r.status == 200 and r.getheader("content-type").startswith("text/plain")
    samples = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples["dsv4_completion_tokens_total"].value >= 2 and samples["dsv4_prompt_tokens_total"].value > 0
    assert samples["dsv4_requests_served_total"].value >= 1 and samples["dsv4_resident_memory_bytes"].value > 1e7
    assert samples["dsv4_prefill_seconds_total"].value > 0 and "dsv4_expert_disk_read_bytes_total" in samples
    assert "dsv4_prefix_cache_hits_total" in samples and "dsv4_queue_requests" in samples
    routes = [
        s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == "dsv4_http_requests_total"
    ]
    assert any(s.labels == {"route": "/v1/chat/completions", "status": "200"} and s.value >= 1 for s in routes)
