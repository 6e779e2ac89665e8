"""`POST /v1/responses`: OpenAI's Responses API over the same prompt and engine path.

Owns: translating a Responses request (`input` as text or items: messages with
input_text/output_text parts, function_call, function_call_output, reasoning;
`instructions`; function `tools`; `tool_choice`; `reasoning.effort`; `text.format`;
`max_output_tokens`; `previous_response_id`; V4.1 `input_image` parts, `server.images`) into the chat body `prompt` renders, and the
answer back: output items (reasoning, message, function_call), `status` / `incomplete_details`,
usage with cached and reasoning tokens, and the streaming events (response.created,
response.in_progress, output_item.added/done, content_part.added/done,
output_text.delta/done, reasoning_text.delta/done, function_call_arguments.delta/done,
response.completed or response.incomplete), each with its `sequence_number`.

`previous_response_id`: each answered response (unless `store: false`) is kept in memory
(the last MAX_KEPT) as the chat messages that produced it plus its answer; a request that
names it continues that conversation. Its prompt then extends the previous one token for
token, so the prefix cache reads it back instead of prefilling it again. Instructions are
not carried over (OpenAI's rule): each request gives its own.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, TypeAdapter, model_validator

from ..text.tokenizer import Tokenizer
from . import toolkit
from .decoding import logprob_json
from .images import ImagePolicy, inline
from .prompt import chat_prompt
from .reply import Outcome
from .schemas import TEXT_ONLY, ChatRequest, Seed, Speculate, _Body, _unsupported, only, union_of
from .toolgrammar import request_shape
from .toolkit import ApiError, Events, Meta, ServerState
from .worker import Job

MAX_KEPT = 256  # responses kept for previous_response_id


LOGPROBS = "message.output_text.logprobs"
ENCRYPTED = "reasoning.encrypted_content"


class FunctionTool(_Body):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # true: the call's arguments are grammar-constrained to `parameters`


class NamedTool(_Body):
    type: Literal["function"]
    name: str


class Reasoning(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto"] | None = None  # the server's choice: the reasoning whole, no summary
    generate_summary: Literal["auto"] | None = None  # the old name of summary


class FormatText(_Body):
    type: Literal["text"]


class FormatJsonObject(_Body):
    type: Literal["json_object"]


class FormatJsonSchema(_Body):
    type: Literal["json_schema"]
    name: str  # its form is checked as chat's response_format name
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


TextFormat = union_of(
    {"text": FormatText, "json_object": FormatJsonObject, "json_schema": FormatJsonSchema},
    _unsupported("format type", "give text, json_object or json_schema"),
)


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the default, the only one


class ResponseStreamOptions(_Body):
    include_obfuscation: only(False) = False


Status = Literal["in_progress", "completed", "incomplete"]


class InputText(_Body):
    """A message's text part: input_text (what a client writes) or output_text (an answer sent back)."""

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # an output_text sent back as it came
    logprobs: list[Any] | None = None


class InputImage(_Body):
    """An image (V4.1 with a vision tower): a data: URI, or an http(s) URL with --allow-image-urls."""

    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None  # one size plan here: the checkpoint's


Parts = list[
    union_of({**{k: InputText for k in ("input_text", "output_text", "text")}, "input_image": InputImage},
             _unsupported("part", TEXT_ONLY))
]  # fmt: skip


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Parts
    id: str | None = None
    status: Status | None = None


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | Parts
    id: str | None = None
    status: Status | None = None


class ReasoningPart(_Body):
    type: Literal["reasoning_text"]
    text: str


class SummaryPart(_Body):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None
    status: Status | None = None


ITEMS = "item type", "give message, function_call, function_call_output or reasoning items"
InputItem = union_of(
    {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
     "reasoning": ReasoningItem},
    _unsupported(*ITEMS), default="message",
)  # fmt: skip


_ITEM = TypeAdapter(InputItem)


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache matches the tokens themselves
    service_tier: Literal["auto", "default"] | None = None
    seed: Seed | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop turns: a prompt over --ctx is a 400 instead
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    speculate: Speculate | None = None

    @model_validator(mode="after")
    def _top_logprobs_with_include(self):
        if self.top_logprobs is not None and LOGPROBS not in (self.include or ()):
            raise ValueError(f"top_logprobs: needs include: [{LOGPROBS!r}]")
        return self


class Kept:
    """Answered responses by id, least recently used dropped beyond MAX_KEPT."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, rid: str) -> list[dict[str, Any]] | None:
        with self._lock:
            got = self._items.get(rid)
            if got is not None:
                self._items.move_to_end(rid)
            return got

    def put(self, rid: str, messages: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[rid] = messages
            while len(self._items) > MAX_KEPT:
                self._items.popitem(last=False)


def add_routes(app: FastAPI, srv: ServerState) -> None:
    kept = Kept()

    @app.post("/v1/responses")
    async def responses(request: Request):
        worker = toolkit.ready(srv)
        body = await toolkit.read_body(request, srv)

        def parse():
            req = toolkit.validate(ResponsesRequest, body)
            toolkit.check_length(srv, body["input"], body.get("instructions"))
            history = []
            if req.previous_response_id is not None:
                history = kept.get(req.previous_response_id)
                if history is None:
                    raise ApiError(404, f"no response {req.previous_response_id!r} is kept here (the server keeps the"
                                   f" last {MAX_KEPT}, in memory)", code="previous_response_not_found",
                                   param="previous_response_id")  # fmt: skip
            conversation = [*history, *toolkit.build(lambda: input_messages(req.input, srv.images))]
            chat_body = to_chat(req, conversation)
            creq = toolkit.validate(ChatRequest, chat_body, RENAMES)
            prompt = toolkit.build(lambda: chat_prompt(srv.tok, creq, chat_body, srv.encoder, srv.images))
            grammar = toolkit.build(lambda: request_shape(srv.grammars, creq, chat_body, prompt.tools, prompt.grammar))
            return req, creq, conversation, prompt, grammar

        req, creq, conversation, prompt, grammar = await asyncio.to_thread(parse)
        top = (req.top_logprobs or 0) if LOGPROBS in (req.include or ()) else None
        job, events = toolkit.make_job(srv, prompt, req.max_output_tokens, creq, top, grammar, req.speculate)
        request.state.usage = job.usage
        toolkit.submit(srv, worker, job)
        meta = Meta("resp", srv.model)
        shell = _shell(req, meta)
        show = _Show(srv.tok if top is not None else None, ENCRYPTED in (req.include or ()))

        def keep(outcome: Outcome) -> None:
            if req.store:
                kept.put(meta.id, [*conversation, _assistant(outcome, meta)])

        if req.stream:
            return toolkit.sse_response(_stream(job, events, meta, shell, srv.keepalive, prompt.thinking, keep, show))
        outcome = (await toolkit.wait_done(job, events, request))[0]
        keep(outcome)
        return _final(shell, job, outcome, meta, prompt.thinking, show)


def input_messages(given: str | list, images: ImagePolicy | None = None) -> list[dict[str, Any]]:
    """Responses input items (`InputItem`s, or their JSON, checked here) -> chat messages (OpenAI chat JSON).
    `input_image` parts become image_url parts in place (checked first by `images.inline`)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict[str, Any]] = []
    reasoning = ""
    for i, item in enumerate(given):
        if isinstance(item, dict):
            item = _ITEM.validate_python(item)
        if isinstance(item, MessageItem):
            msg: dict[str, Any] = {"role": item.role, "content": _content(item.content, f"input.{i}.content", images)}
            if item.role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = reasoning, ""
            out.append(msg)
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                if reasoning:
                    last["reasoning_content"], reasoning = reasoning, ""
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _parts_text(item.output)})
        elif isinstance(item, ReasoningItem):
            text = "".join(p.text for p in [*(item.content or ()), *item.summary])
            if not text and item.encrypted_content is not None:
                text = decrypt(item.encrypted_content, f"input.{i}.encrypted_content")
            reasoning += text
        else:
            raise TypeError(f"input item {i} was not checked: {item!r}")
    return out


def _parts_text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _content(content: str | list, where: str, images: ImagePolicy | None) -> str | list[dict[str, Any]]:
    """A message's content: its text parts joined; with images, chat parts in order (each run
    of text parts joined as before, an image_url part for each image)."""
    if isinstance(content, str) or not any(isinstance(p, InputImage) for p in content):
        return _parts_text(content)
    out: list[dict[str, Any]] = []
    for j, p in enumerate(content):
        if isinstance(p, InputImage):
            out.append(
                {"type": "image_url", "image_url": {"url": inline(images, f"{where}.{j}.image_url", p.image_url)}}
            )
        elif out and out[-1]["type"] == "text":
            out[-1]["text"] += p.text
        else:
            out.append({"type": "text", "text": p.text})
    return out


# a field of the chat request translated from a Responses one -> the Responses field it came from
RENAMES = (
    (r"^tools\.(\d+)\.function\.", r"tools.\1."),
    (r"^response_format\.json_schema\b", "text.format"),
    (r"^response_format\b", "text.format"),
    (r"^max_tokens\b", "max_output_tokens"),
    (r"^reasoning_effort\b", "reasoning.effort"),
    (r"^messages\b(\.\d+)?", "input"),  # instructions and history shift the chat messages' indices
)


def to_chat(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"messages": [*messages, *conversation]}
    for key, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                       ("top_p", req.top_p), ("seed", req.seed), ("parallel_tool_calls", req.parallel_tool_calls)):  # fmt: skip
        if value is not None:
            body[key] = value
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in req.tools]  # fmt: skip
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, FormatJsonSchema):
        spec = fmt.model_dump(exclude_none=True, by_alias=True, exclude={"type"})
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    return body


def _assistant(outcome: Outcome, meta: Meta) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": outcome.content}
    if outcome.reasoning:
        msg["reasoning_content"] = outcome.reasoning
    if outcome.tool_calls:
        msg["tool_calls"] = [
            {"id": meta.call_id(i), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(outcome.tool_calls)
        ]
    return msg


def _shell(req: ResponsesRequest, meta: Meta) -> dict[str, Any]:
    """The response object's fields that do not depend on the answer."""
    return {
        "id": meta.id, "object": "response", "created_at": meta.created, "model": meta.model,
        "status": "in_progress", "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {}, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning.model_dump(exclude_none=True) if req.reasoning else {"effort": None},
        "store": req.store, "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": {"format": {"type": "text"}, **(req.text.model_dump(exclude_none=True, by_alias=True) if req.text else {})},
        "tool_choice": _dump(req.tool_choice) if req.tool_choice is not None else "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()], "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": req.truncation or "disabled", "user": req.user, "usage": None,
    }  # fmt: skip


def _dump(value: Any) -> Any:
    return value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value


@dataclass(frozen=True)
class _Show:
    """What `include` asked for: the tokenizer when logprobs are wanted, and the reasoning as
    `encrypted_content` (for clients that keep no state: store false)."""

    lp_tok: Tokenizer | None = None
    encrypted: bool = False

    def logprobs(self, entries: list) -> list[dict[str, Any]] | None:
        return logprob_json(self.lp_tok, entries) if self.lp_tok is not None else None

    def reasoning_item(self, rs_id: str, text: str) -> dict[str, Any]:
        item = {"type": "reasoning", "id": rs_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}
        if self.encrypted:
            item["encrypted_content"] = encrypt(text)
        return item


_SEALED = "dsv4r1:"  # encrypted_content here is the reasoning's UTF-8, base64, behind this mark (nothing secret)


def encrypt(reasoning: str) -> str:
    return _SEALED + base64.b64encode(reasoning.encode()).decode()


def decrypt(blob: Any, where: str) -> str:
    if not isinstance(blob, str) or not blob.startswith(_SEALED):
        raise ApiError(400, f"{where}: not an encrypted_content this server wrote", param="input")
    try:
        return base64.b64decode(blob[len(_SEALED) :], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ApiError(400, f"{where}: damaged encrypted_content", param="input") from None


def _items(outcome: Outcome, meta: Meta, thinking: bool, show: _Show) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if thinking and outcome.reasoning:
        items.append(show.reasoning_item(f"rs_{meta.id[5:]}", outcome.reasoning))
    if outcome.content or not outcome.tool_calls:
        items.append(_message(meta, outcome.content, "completed", show.logprobs(outcome.logprobs)))
    for i, c in enumerate(outcome.tool_calls):
        items.append({"type": "function_call", "id": f"fc_{meta.id[5:]}_{i}", "call_id": meta.call_id(i),
                      "name": c.name, "arguments": c.arguments, "status": "completed"})  # fmt: skip
    return items


def _message(meta: Meta, text: str, status: str, logprobs: list | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    content = [part] if status == "completed" else []
    return {"type": "message", "id": f"msg_{meta.id[5:]}", "status": status, "role": "assistant", "content": content}


def _usage(job: Job, outcome: Outcome, thinking: bool) -> dict[str, Any]:
    u = job.usage
    reasoning = 0
    if thinking and outcome.reasoning:
        reasoning = len(job.reply.tok.encode(outcome.reasoning))
    return {
        "input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning, u.completion_tokens)},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }  # fmt: skip


def _final(
    shell: dict[str, Any], job: Job, outcome: Outcome, meta: Meta, thinking: bool, show: _Show
) -> dict[str, Any]:
    done = outcome.finish_reason != "length"
    return {
        **shell, "status": "completed" if done else "incomplete",
        "incomplete_details": None if done else {"reason": "max_output_tokens"},
        "output": _items(outcome, meta, thinking, show), "usage": _usage(job, outcome, thinking),
    }  # fmt: skip


async def _stream(job: Job, events: Events, meta: Meta, shell: dict[str, Any], keepalive: float, thinking: bool,
                  keep, show: _Show = _Show()) -> AsyncIterator[str]:  # fmt: skip
    seq = 0

    def ev(name: str, **data: Any) -> str:
        nonlocal seq
        seq += 1
        return f"event: {name}\ndata: {json.dumps({'type': name, 'sequence_number': seq - 1, **data}, ensure_ascii=False)}\n\n"

    yield ev("response.created", response=shell)
    yield ev("response.in_progress", response=shell)
    out_index = -1
    open_kind: str | None = None  # "reasoning" or "message"
    text = ""
    lps: list = []  # the open message's tokens' logprobs (include: message.output_text.logprobs)
    rs_id, msg_id = f"rs_{meta.id[5:]}", f"msg_{meta.id[5:]}"

    def close() -> list[str]:
        nonlocal open_kind, text, lps
        if open_kind == "reasoning":
            item = show.reasoning_item(rs_id, text)
            out = [ev("response.reasoning_text.done", item_id=rs_id, output_index=out_index, content_index=0, text=text),
                   ev("response.output_item.done", output_index=out_index, item=item)]  # fmt: skip
        elif open_kind == "message":
            item = _message(meta, text, "completed", show.logprobs(lps))
            part = item["content"][0]
            out = [ev("response.output_text.done", item_id=msg_id, output_index=out_index, content_index=0, text=text,
                      logprobs=part.get("logprobs", [])),
                   ev("response.content_part.done", item_id=msg_id, output_index=out_index, content_index=0, part=part),
                   ev("response.output_item.done", output_index=out_index, item=item)]  # fmt: skip
        else:
            out = []
        open_kind, text, lps = None, "", []
        return out

    def open_(kind: str) -> list[str]:
        nonlocal open_kind, out_index
        out = close()
        out_index += 1
        open_kind = kind
        if kind == "reasoning":
            item = {"type": "reasoning", "id": rs_id, "summary": [], "content": []}
            return [*out, ev("response.output_item.added", output_index=out_index, item=item)]
        part = {"type": "output_text", "text": "", "annotations": []}
        return [*out, ev("response.output_item.added", output_index=out_index, item=_message(meta, "", "in_progress")),
                ev("response.content_part.added", item_id=msg_id, output_index=out_index, content_index=0, part=part)]  # fmt: skip

    calls = 0
    async for kind, payload in toolkit.job_events(job, events, keepalive):
        if kind in ("comment", "progress"):
            yield ": keep-alive\n\n"
        elif kind == "delta":
            if payload.reasoning:
                if open_kind != "reasoning":
                    for s in open_("reasoning"):
                        yield s
                text += payload.reasoning
                yield ev("response.reasoning_text.delta", item_id=rs_id, output_index=out_index, content_index=0,
                         delta=payload.reasoning)  # fmt: skip
            if payload.content or (payload.logprobs and not payload.reasoning):
                if open_kind != "message":
                    for s in open_("message"):
                        yield s
                text += payload.content
                lps += payload.logprobs
                yield ev("response.output_text.delta", item_id=msg_id, output_index=out_index, content_index=0,
                         delta=payload.content, logprobs=show.logprobs(payload.logprobs) or [])  # fmt: skip
            for c in payload.tool_calls:
                for s in close():
                    yield s
                out_index += 1
                item = {"type": "function_call", "id": f"fc_{meta.id[5:]}_{calls}", "call_id": meta.call_id(calls),
                        "name": c.name, "arguments": "", "status": "in_progress"}  # fmt: skip
                yield ev("response.output_item.added", output_index=out_index, item=item)
                yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=out_index,
                         delta=c.arguments)  # fmt: skip
                yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=out_index,
                         name=c.name, arguments=c.arguments)  # fmt: skip
                yield ev("response.output_item.done", output_index=out_index,
                         item={**item, "arguments": c.arguments, "status": "completed"})  # fmt: skip
                calls += 1
        elif kind == "done":
            outcome = payload[0]
            if open_kind is None and not outcome.tool_calls and out_index < 0:
                for s in open_("message"):
                    yield s
            for s in close():
                yield s
            keep(outcome)
            final = _final(shell, job, outcome, meta, thinking, show)
            yield ev("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
        elif kind == "error":
            a = toolkit.engine_error(payload)
            yield ev("error", code=a.code or a.kind, message=a.message, param=None)
            failed = {**shell, "status": "failed", "error": {"code": "server_error", "message": a.message}}
            yield ev("response.failed", response=failed)
