"""`POST /v1/messages`: Anthropic's Messages API over the same prompt and engine path.

Owns: translating an Anthropic request (system text or blocks; messages whose content is
text, `thinking`, `tool_use` and `tool_result` blocks; tools with `input_schema`;
`thinking: {"type": "enabled"}`; `stop_sequences`) into the OpenAI chat body `prompt`
already renders, and the answer back: content blocks (thinking, text, tool_use),
`stop_reason` (end_turn, max_tokens, stop_sequence, tool_use), usage with
`cache_read_input_tokens` (input_tokens counts only what was not read from the prefix
cache, the same in message_start and message_delta: message_start waits for the engine to
have looked the prompt up, with SSE comments meanwhile), the streaming events
(message_start, content_block_*, message_delta, message_stop; `ping` while a prefill
runs), `POST /v1/messages/count_tokens`, and errors in Anthropic's shape (`errors`).
Content is text, and on a V4.1 checkpoint with a vision tower `image` blocks of user messages
(source base64, or url with `dsv4 serve --allow-image-urls`; `server.images`); a document or
any other block, at the top level or inside a tool_result, is a 400.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request

from . import toolkit
from .errors import anthropic_error
from .images import ImagePolicy, inline
from .prompt import chat_prompt
from .reply import Outcome
from .schemas import AnthropicRequest, AnthropicText, ChatRequest, CountRequest
from .toolgrammar import request_shape
from .toolkit import ApiError, Events, Meta, ServerState
from .worker import Job


def add_routes(app: FastAPI, srv: ServerState) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request):
        worker = toolkit.ready(srv)
        body = await toolkit.read_body(request, srv)

        def parse():
            req = toolkit.validate(AnthropicRequest, body)
            toolkit.check_length(srv, body["messages"], body.get("system"))
            chat_body = toolkit.build(lambda: to_openai(req, images=srv.images))
            creq = toolkit.validate(ChatRequest, chat_body, RENAMES)
            prompt = toolkit.build(lambda: chat_prompt(srv.tok, creq, chat_body, srv.encoder, srv.images))
            return (
                req,
                creq,
                prompt,
                toolkit.build(lambda: request_shape(srv.grammars, creq, chat_body, prompt.tools, prompt.grammar)),
            )

        req, creq, prompt, grammar = await asyncio.to_thread(parse)
        job, events = toolkit.make_job(srv, prompt, req.max_tokens, creq, None, grammar, req.speculate)
        request.state.usage = job.usage
        toolkit.submit(srv, worker, job)
        meta = Meta("msg", srv.model)
        if req.stream:
            return toolkit.sse_response(_stream(job, events, meta, srv.keepalive, len(prompt.ids)))
        outcome = (await toolkit.wait_done(job, events, request))[0]
        blocks: list[dict[str, Any]] = []
        if prompt.thinking and outcome.reasoning:
            blocks.append({"type": "thinking", "thinking": outcome.reasoning, "signature": ""})
        if outcome.content:
            blocks.append({"type": "text", "text": outcome.content})
        for i, c in enumerate(outcome.tool_calls):
            blocks.append({"type": "tool_use", "id": meta.call_id(i), "name": c.name, "input": json.loads(c.arguments)})
        return {
            "id": meta.id, "type": "message", "role": "assistant", "model": srv.model, "content": blocks,
            "stop_reason": _stop_reason(outcome, job), "stop_sequence": _stop_sequence(outcome, job),
            "usage": _usage(job),
        }  # fmt: skip

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        body = await toolkit.read_body(request, srv)

        def count() -> int:
            req = toolkit.validate(CountRequest, body)
            chat_body = toolkit.build(lambda: to_openai(req, images=srv.images))
            creq = toolkit.validate(ChatRequest, chat_body, RENAMES)
            return len(toolkit.build(lambda: chat_prompt(srv.tok, creq, chat_body, srv.encoder, srv.images)).ids)

        return {"input_tokens": await asyncio.to_thread(count)}


# a field of the chat request translated from an Anthropic one -> the Anthropic field it came
# from, for the rare check only the chat request makes (the Anthropic models check the rest)
RENAMES = (
    (r"^stop\b", "stop_sequences"),
    (r"^tools\.(\d+)\.function\.parameters\b", r"tools.\1.input_schema"),
    (r"^tools\.(\d+)\.function\.", r"tools.\1."),
    (r"^reasoning_effort\b", "output_config.effort"),
    (r"^response_format\.json_schema\.schema\b", "output_config.format.schema"),
    (r"^response_format\b", "output_config.format"),
    (r"^parallel_tool_calls\b", "tool_choice.disable_parallel_tool_use"),
    (r"^messages\.\d+\b", "messages"),  # system and tool results shift the chat messages' indices
)


def to_openai(req: CountRequest, max_tokens: int = 1, images: ImagePolicy | None = None) -> dict[str, Any]:
    """The chat body of an Anthropic request (a count_tokens one has no max_tokens: any will do).
    Image blocks of user messages become image_url parts in place (`images.inline` checks them
    under their own field names first)."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    for i, m in enumerate(req.messages):
        role = m.role
        blocks = [AnthropicText(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        texts, calls, reasoning, parts = [], [], "", []
        for j, b in enumerate(blocks):
            kind = b.type
            if kind == "text":
                texts.append(b.text)
                parts.append({"type": "text", "text": b.text})
            elif kind == "image" and role == "user":
                src, where = b.source, f"messages.{i}.content.{j}.source"
                if src.type == "base64":
                    url = inline(images, f"{where}.data", data=src.data, media_type=src.media_type)
                else:
                    url = inline(images, f"{where}.url", url=src.url)
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif kind == "thinking" and role == "assistant":
                reasoning += b.thinking
            elif kind == "tool_use" and role == "assistant":
                fn = {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}
                calls.append({"id": b.id, "type": "function", "function": fn})
            elif kind == "tool_result" and role == "user":
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
            else:
                raise ApiError(400, f"messages.{i}.content.{j}: a {kind} block cannot be in a message of role {role}",
                               code="invalid_field", param=f"messages.{i}.content.{j}")  # fmt: skip
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if reasoning:
                msg["reasoning_content"] = reasoning
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif len(parts) > len(texts):  # images: the parts in order (joined by blank lines, as the text is)
            out.append({"role": "user", "content": parts})
        elif texts:
            out.append({"role": "user", "content": "\n\n".join(texts)})
    body: dict[str, Any] = {"messages": out, "max_tokens": getattr(req, "max_tokens", max_tokens)}
    for key in ("temperature", "top_p", "top_k"):
        if getattr(req, key, None) is not None:
            body[key] = getattr(req, key)
    if getattr(req, "stop_sequences", None):
        body["stop"] = req.stop_sequences
    thinking = req.thinking is not None and req.thinking.type != "disabled"
    if req.thinking is not None:
        body["thinking"] = {"type": "enabled" if thinking else "disabled"}
        if req.thinking.budget_tokens is not None:
            body["thinking"]["budget_tokens"] = req.thinking.budget_tokens
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": {k: v for k, v in (("name", t.name), ("description", t.description),
             ("parameters", t.input_schema), ("strict", t.strict)) if v is not None}}
            for t in req.tools
        ]  # fmt: skip
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    out_cfg = req.output_config
    if out_cfg is not None and out_cfg.effort is not None:
        if not thinking:
            raise ApiError(400, "output_config.effort: the effort is that of the reasoning; turn thinking on",
                           code="invalid_field", param="output_config.effort")  # fmt: skip
        body["reasoning_effort"] = out_cfg.effort
    if out_cfg is not None and out_cfg.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                   "schema": out_cfg.format.schema_}}  # fmt: skip
    return body


def _text(content: str | list[AnthropicText] | None) -> str:
    """System text or a tool result's content: text, or text blocks (others were refused when checked)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n\n".join(b.text for b in content)


def _stop_sequence(outcome: Outcome, job: Job) -> str | None:
    return job.reply.stop_hit if _stop_reason(outcome, job) == "stop_sequence" else None


def _stop_reason(outcome: Outcome, job: Job) -> str:
    if outcome.finish_reason == "tool_calls":
        return "tool_use"
    if outcome.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if job.reply.stopped else "end_turn"


def _usage(job: Job) -> dict[str, int]:
    u = job.usage
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    }


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


async def _stream(job: Job, events: Events, meta: Meta, keepalive: float, n_prompt: int) -> AsyncIterator[str]:
    def start() -> str:
        message = {
            "id": meta.id, "type": "message", "role": "assistant", "model": meta.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {**_usage(job), "output_tokens": 0},
        }  # fmt: skip
        return _event("message_start", {"message": message})

    started = False
    index, open_kind = -1, None

    def close() -> list[str]:
        """The open block's end; a thinking block's carries its `signature_delta` first, as
        Anthropic's stream does (the signature is "", as in the non-streamed block)."""
        if open_kind is None:
            return []
        out = [_event("content_block_stop", {"index": index})]
        if open_kind == "thinking":
            out.insert(
                0,
                _event("content_block_delta", {"index": index, "delta": {"type": "signature_delta", "signature": ""}}),
            )
        return out

    def switch(kind: str, start: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        out = close()
        index, open_kind = index + 1, kind
        return [*out, _event("content_block_start", {"index": index, "content_block": start})]

    async for kind, payload in toolkit.job_events(job, events, keepalive):
        if not started and kind in ("started", "error"):
            started = True
            if kind == "started":
                yield start()
                continue
        if not started:
            if kind == "comment":
                yield f": {payload}\n\n"
        elif kind in ("comment", "progress"):
            yield _event("ping", {})
        elif kind == "delta":
            for text, block, delta in (
                (payload.reasoning, {"type": "thinking", "thinking": ""}, "thinking_delta"),
                (payload.content, {"type": "text", "text": ""}, "text_delta"),
            ):
                if not text:
                    continue
                if open_kind != block["type"]:
                    for s in switch(block["type"], block):
                        yield s
                field = "thinking" if delta == "thinking_delta" else "text"
                yield _event("content_block_delta", {"index": index, "delta": {"type": delta, field: text}})
            for c in payload.tool_calls:
                start = {"type": "tool_use", "id": meta.call_id(index + 1), "name": c.name, "input": {}}
                for s in switch("tool_use", start):
                    yield s
                delta = {"type": "input_json_delta", "partial_json": c.arguments}
                yield _event("content_block_delta", {"index": index, "delta": delta})
        elif kind == "done":
            for s in close():
                yield s
            delta = {"stop_reason": _stop_reason(payload[0], job), "stop_sequence": _stop_sequence(payload[0], job)}
            yield _event("message_delta", {"delta": delta, "usage": _usage(job)})
            yield _event("message_stop", {})
        elif kind == "error":
            a = toolkit.engine_error(payload)
            yield _event("error", {"error": anthropic_error(a.status, a.message)["error"]})
