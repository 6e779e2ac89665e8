"""OpenAI's routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions` and
`POST /v1/completions`, and their shapes.

Owns: the model card; a chat completion's body (message with `reasoning_content` and
`tool_calls`, `logprobs`, usage with cached tokens) and its SSE chunks (one per token that
adds text, one per tool call, `: prefill n/N` and the page's `: dsv4 {...}` comments, an
engine failure as a `data:` error body, `data: [DONE]` at the end); a legacy completion's
body and chunks (`logprobs` with `text_offset`). Reading, checking and queueing a request
is `toolkit`'s; the Anthropic and Responses APIs are their own modules.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request

from ..text.chat import ToolCall
from ..text.tokenizer import Tokenizer
from . import toolkit
from .decoding import logprob_json
from .errors import openai_error
from .grammar import Shape
from .page import PAGE_EVENTS, page_comment
from .prompt import Prompt, chat_prompt, completion_prompt
from .reply import Delta, Outcome
from .schemas import ChatRequest, CompletionRequest
from .toolgrammar import request_shape
from .toolkit import ApiError, Events, Meta, ServerState
from .worker import Job, Usage


def model_card(srv: ServerState) -> dict[str, Any]:
    return {"id": srv.model, "object": "model", "created": int(srv.started), "owned_by": "dsv4stream"}


def add_routes(app: FastAPI, srv: ServerState) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(srv)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != srv.model:
            raise ApiError(404, f"model {model_id!r} is not served here; this server serves {srv.model!r}",
                           code="model_not_found", param="model")  # fmt: skip
        return model_card(srv)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        worker = toolkit.ready(srv)
        body = await toolkit.read_body(request, srv)

        def parse() -> tuple[ChatRequest, Prompt, Shape | None]:
            req = toolkit.validate(ChatRequest, body)
            toolkit.check_length(srv, body["messages"])
            prompt = toolkit.build(lambda: chat_prompt(srv.tok, req, body, srv.encoder, srv.images))
            return (
                req,
                prompt,
                toolkit.build(lambda: request_shape(srv.grammars, req, body, prompt.tools, prompt.grammar)),
            )

        req, prompt, grammar = await asyncio.to_thread(parse)
        top = (req.top_logprobs or 0) if req.logprobs else None
        job, events = toolkit.make_job(srv, prompt, req.max_completion_tokens or req.max_tokens, req, top, grammar)
        request.state.usage = job.usage
        toolkit.submit(srv, worker, job)
        meta = Meta("chatcmpl", srv.model, include_usage=bool(req.stream_options and req.stream_options.include_usage))
        if req.stream:
            return toolkit.sse_response(chat_chunks(job, events, meta, srv.keepalive))
        outcomes = await toolkit.wait_done(job, events, request)
        return chat_body(meta, outcomes, prompt.thinking, job.usage, srv.tok if top is not None else None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        worker = toolkit.ready(srv)
        body = await toolkit.read_body(request, srv)

        def parse() -> tuple[CompletionRequest, Prompt]:
            req = toolkit.validate(CompletionRequest, body)
            toolkit.check_length(srv, body["prompt"])
            return req, toolkit.build(lambda: completion_prompt(srv.tok, req))

        req, prompt = await asyncio.to_thread(parse)
        job, events = toolkit.make_job(srv, prompt, req.max_tokens, req, req.logprobs)
        request.state.usage = job.usage
        toolkit.submit(srv, worker, job)
        meta = Meta("cmpl", srv.model, include_usage=bool(req.stream_options and req.stream_options.include_usage))
        lp_tok = srv.tok if req.logprobs is not None else None
        if req.stream:
            return toolkit.sse_response(_completion_chunks(job, events, meta, srv.keepalive, lp_tok))
        outcomes = await toolkit.wait_done(job, events, request)
        choices = [
            {"index": o.index, "text": o.content, "finish_reason": o.finish_reason,
             "logprobs": legacy_logprobs(lp_tok, o.logprobs, 0) if lp_tok is not None else None}
            for o in outcomes
        ]  # fmt: skip
        return envelope(meta, "text_completion", choices, job.usage)


# ---- bodies and chunks -----------------------------------------------------------------------


def envelope(meta: Meta, obj: str, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
    """The fields every chat and completion body and chunk carries around its `choices`."""
    out: dict[str, Any] = {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model}
    out["choices"] = choices
    if usage is not None:
        out["usage"] = usage_json(usage)
    return out


def chat_body(
    meta: Meta, outcomes: list[Outcome], thinking: bool, usage: Usage, lp_tok: Tokenizer | None = None
) -> dict[str, Any]:
    """`lp_tok`: the tokenizer when logprobs were asked for."""
    choices, calls = [], 0
    for o in outcomes:
        message: dict[str, Any] = {"role": "assistant", "content": o.content or None}
        if thinking:
            message["reasoning_content"] = o.reasoning
        if o.tool_calls:
            message["tool_calls"] = [_call_json(c, meta.call_id(calls + i)) for i, c in enumerate(o.tool_calls)]
            calls += len(o.tool_calls)
        lp = {"content": logprob_json(lp_tok, o.logprobs), "refusal": None} if lp_tok is not None else None
        choices.append({"index": o.index, "message": message, "finish_reason": o.finish_reason, "logprobs": lp})
    return envelope(meta, "chat.completion", choices, usage)


def legacy_logprobs(tok: Tokenizer, entries: list, offset: int) -> dict[str, Any]:
    """The `logprobs` object of /v1/completions: tokens, token_logprobs, top_logprobs, text_offset."""
    items = logprob_json(tok, entries)
    offsets, at = [], offset
    for it in items:
        offsets.append(at)
        at += len(it["token"])
    return {
        "tokens": [it["token"] for it in items],
        "token_logprobs": [it["logprob"] for it in items],
        "top_logprobs": [{t["token"]: t["logprob"] for t in it["top_logprobs"]} for it in items],
        "text_offset": offsets,
    }


def usage_json(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _call_json(c: ToolCall, call_id: str, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {} if index is None else {"index": index}
    out |= {"id": call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
    return out


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def stream_error(e: BaseException) -> str:
    """An engine failure in the middle of an OpenAI chat or completion stream: a `data:` line
    holding OpenAI's error body (the client raises it), then the stream's end."""
    a = toolkit.engine_error(e)
    return _data(openai_error(a.message, a.kind, a.code))


async def chat_chunks(job: Job, events: Events, meta: Meta, keepalive: float) -> AsyncIterator[str]:
    lp_tok = job.reply.tok if job.controls.top_logprobs is not None else None

    def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0, lp: list | None = None) -> str:
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
        if lp_tok is not None:
            choice["logprobs"] = {"content": logprob_json(lp_tok, lp or []), "refusal": None} if lp else None
        return _data(envelope(meta, "chat.completion.chunk", [choice]))

    for i in range(len(job.replies)):  # content null, as llama.cpp and OpenAI (before a tool call) send it
        yield chunk({"role": "assistant", "content": None}, index=i)
    calls = 0
    async for kind, payload in toolkit.job_events(job, events, keepalive):
        if kind == "comment":
            yield f": {payload}\n\n"
        elif kind == "progress":
            yield f": prefill {payload[0]}/{payload[1]}\n\n"
        elif kind in PAGE_EVENTS:
            yield page_comment(kind, payload)
        elif kind == "delta":
            d: Delta = payload
            if d.reasoning:
                yield chunk({"reasoning_content": d.reasoning}, index=d.index)
            if d.content or (d.logprobs and not d.reasoning):
                yield chunk({"content": d.content}, index=d.index, lp=d.logprobs)
            for c in d.tool_calls:
                yield chunk({"tool_calls": [_call_json(c, meta.call_id(calls), index=calls)]}, index=d.index)
                calls += 1
        elif kind == "finish":
            yield chunk({}, payload.finish_reason, index=payload.index)
        elif kind == "done":
            if meta.include_usage:
                yield _data(envelope(meta, "chat.completion.chunk", [], job.usage))
            yield "data: [DONE]\n\n"
        elif kind == "error":
            yield stream_error(payload)
            yield "data: [DONE]\n\n"


async def _completion_chunks(
    job: Job, events: Events, meta: Meta, keepalive: float, lp_tok: Tokenizer | None = None
) -> AsyncIterator[str]:
    offsets = [0] * len(job.replies)

    def chunk(text: str, finish: str | None = None, index: int = 0, lp: list | None = None) -> str:
        logprobs = legacy_logprobs(lp_tok, lp or [], offsets[index]) if lp_tok is not None and lp else None
        offsets[index] += len(text)
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return _data(envelope(meta, "text_completion", [choice]))

    async for kind, payload in toolkit.job_events(job, events, keepalive):
        if kind == "comment":
            yield f": {payload}\n\n"
        elif kind == "progress":
            yield f": prefill {payload[0]}/{payload[1]}\n\n"
        elif kind == "delta" and (payload.content or payload.logprobs):
            yield chunk(payload.content, index=payload.index, lp=payload.logprobs)
        elif kind == "finish":
            yield chunk("", payload.finish_reason, index=payload.index)
        elif kind == "done":
            if meta.include_usage:
                yield _data(envelope(meta, "text_completion", [], job.usage))
            yield "data: [DONE]\n\n"
        elif kind == "error":
            yield stream_error(payload)
            yield "data: [DONE]\n\n"
