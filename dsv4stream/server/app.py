"""The HTTP layer: FastAPI routes in OpenAI's shapes, Server-Sent Events, errors, access log.

Owns: reading and checking a request (size limit, JSON, `schemas`), turning it into a
`Job` (`prompt`), and writing what the engine thread reports back: a JSON body, or SSE
chunks (one per token that adds text; `: keep-alive` comments while the request waits in
the queue or a long prefill runs; `data: [DONE]` at the end). Errors are in the shape of
the API the path belongs to (`errors`): 400 / 404 / 405 / 413 / 429 / 503 / 500; a stack
trace only goes to the server log. Parsing a body and tokenizing its prompt run in a
worker thread, so a large request never holds up the event loop (/health stays fast).
Who may call at all (Host, Origin, content type, key) is `security`'s job. A client that goes away cancels its job: the
engine stops at the next token or prefill chunk. One access-log line per request.
No model logic here: handlers talk to the `Worker` through jobs only.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..errors import Dsv4Error
from ..text import chat
from ..text.chat import ToolCall
from ..text.tokenizer import Tokenizer
from .decoding import Controls, logprob_json
from .errors import error_json, openai_error
from .grammar import Grammars, Shape
from .metrics import Metrics
from .page import PAGE_EVENTS, page_comment
from .prompt import Prompt, chat_prompt, completion_prompt, max_new_tokens, sampling
from .reply import Delta, Outcome, ReplyStream
from .schemas import REFUSED, ChatRequest, CompletionRequest
from .toolgrammar import request_shape
from .worker import Job, Usage, Worker

Log = Callable[[str], None]
STATIC = Path(__file__).with_name("static")  # the chat page: plain HTML/JS/CSS, no build step
MAX_DEPTH = 100  # nesting of a request body: far past any tool schema, far below Python's recursion limit
M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerState:
    """What the routes share; `worker` is None until the model is loaded."""

    model: str
    tok: Tokenizer
    ctx: int
    log: Log
    encoder: str = chat.LATEST  # the checkpoint's chat-format release (reasoning effort)
    keepalive: float = 10.0  # seconds between SSE comments while nothing else is sent
    max_body: int = 8 * 1024 * 1024
    max_queue: int = 64  # requests waiting (not counting the one running) before 429
    worker: Worker | None = None
    started: float = field(default_factory=time.time)
    grammars: Grammars = field(init=False)
    metrics: Metrics | None = None  # set by create_app

    def __post_init__(self) -> None:
        self.grammars = Grammars(self.tok, max(self.tok.vocab_size, self.tok.n_tokens))


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code
        self.headers, self.param = headers, param


error_body = openai_error


def model_card(srv: ServerState) -> dict[str, Any]:
    return {"id": srv.model, "object": "model", "created": int(srv.started), "owned_by": "dsv4stream"}


def create_app(srv: ServerState) -> FastAPI:
    app = FastAPI(title="dsv4stream", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.srv = srv

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        body = error_json(request.url.path, e.message, e.kind, e.code, e.status, e.param)
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        path, method = request.url.path, request.method
        if e.status_code == 404:
            message, code = f"no route {method} {path} (see GET /v1/models, POST /v1/chat/completions)", "not_found"
        elif e.status_code == 405:
            message, code = f"{method} is not allowed on {path}", "method_not_allowed"
        else:
            message, code = str(e.detail), None
        body = error_json(path, message, "invalid_request_error", code, e.status_code)
        return JSONResponse(body, status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        message = f"internal error ({type(e).__name__}); see the server log"
        return JSONResponse(error_json(request.url.path, message, "server_error", None, 500), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if srv.worker is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        w = srv.worker
        body = {"status": "ok", "model": srv.model, "queued": w.queued, "waiting": w.waiting, "running": w.running}
        return JSONResponse(body)

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        worker = srv.worker
        if worker is None:
            return {"model": srv.model, "phase": "loading"}
        return {"model": srv.model, "ctx": srv.ctx, **worker.stats.snapshot(worker.queued)}

    metrics = Metrics(srv)
    srv.metrics = metrics

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

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
        worker = ready(srv)
        body = await read_body(request, srv)

        def parse() -> tuple[ChatRequest, Prompt, Shape | None]:
            req = validate(ChatRequest, body)
            check_length(srv, body["messages"])
            prompt = build(lambda: chat_prompt(srv.tok, req, body, srv.encoder))
            return req, prompt, build(lambda: request_shape(srv.grammars, req, body, prompt.tools, prompt.grammar))

        req, prompt, grammar = await asyncio.to_thread(parse)
        top = (req.top_logprobs or 0) if req.logprobs else None
        job, events = make_job(srv, prompt, req.max_completion_tokens or req.max_tokens, req, top, grammar)
        request.state.usage = job.usage
        submit(srv, worker, job)
        meta = _Meta("chatcmpl", srv.model, include_usage=bool(req.stream_options and req.stream_options.include_usage))
        if req.stream:
            return sse_response(chat_chunks(job, events, meta, srv.keepalive))
        outcomes = await wait_done(job, events, request)
        return chat_body(meta, outcomes, prompt.thinking, job.usage, srv.tok if top is not None else None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        worker = ready(srv)
        body = await read_body(request, srv)

        def parse() -> tuple[CompletionRequest, Prompt]:
            req = validate(CompletionRequest, body)
            check_length(srv, body["prompt"])
            return req, build(lambda: completion_prompt(srv.tok, req))

        req, prompt = await asyncio.to_thread(parse)
        job, events = make_job(srv, prompt, req.max_tokens, req, req.logprobs)
        request.state.usage = job.usage
        submit(srv, worker, job)
        meta = _Meta("cmpl", srv.model, include_usage=bool(req.stream_options and req.stream_options.include_usage))
        lp_tok = srv.tok if req.logprobs is not None else None
        if req.stream:
            return sse_response(_completion_chunks(job, events, meta, srv.keepalive, lp_tok))
        outcomes = await wait_done(job, events, request)
        choices = [
            {"index": o.index, "text": o.content, "finish_reason": o.finish_reason,
             "logprobs": legacy_logprobs(lp_tok, o.logprobs, 0) if lp_tok is not None else None}
            for o in outcomes
        ]  # fmt: skip
        return meta.body("text_completion", choices, job.usage)

    from . import anthropic, responses
    from .page import add_routes as add_page_routes

    anthropic.add_routes(app, srv)
    responses.add_routes(app, srv)
    add_page_routes(app, srv)
    return app


# ---- requests --------------------------------------------------------------------------------


def ready(srv: ServerState) -> Worker:
    if srv.worker is None:
        raise ApiError(503, "the model is still loading; retry when GET /health answers 200", "server_error", "loading",
                       headers={"Retry-After": "5"})  # fmt: skip
    return srv.worker


def submit(srv: ServerState, worker: Worker, job: Job) -> None:
    """Queue the job, or 429 when --max-queue requests already wait."""
    if worker.queued > srv.max_queue:  # it would wait behind max_queue others (the running one included)
        wait = worker.retry_after()
        raise ApiError(429, f"{worker.waiting} requests are waiting (--max-queue {srv.max_queue}); retry in about"
                       f" {wait} s", "rate_limit_error", "queue_full", headers={"Retry-After": str(wait)})  # fmt: skip
    worker.submit(job)


async def read_body(request: Request, srv: ServerState) -> dict[str, Any]:
    """The body as a JSON object: at most --max-body-mb, nested at most MAX_DEPTH deep, parsed
    in a worker thread."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > srv.max_body:
        raise ApiError(413, f"request body of {declared} bytes is over the limit of {srv.max_body}", code="too_large")
    chunks, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > srv.max_body:
                raise ApiError(413, f"request body is over the limit of {srv.max_body} bytes", code="too_large")
            chunks.append(part)
    except ClientDisconnect:
        raise ApiError(499, "client closed the request", code="client_gone") from None
    return await asyncio.to_thread(parse_json, b"".join(chunks))


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        why = "nested too deeply" if "depth" in str(e) else str(e)
        raise ApiError(400, f"the body is not valid JSON ({why})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    if depth(body) > MAX_DEPTH:
        raise ApiError(400, f"the body is nested more than {MAX_DEPTH} levels deep", code="invalid_json")
    return body


def check_length(srv: ServerState, *parts: Any) -> None:
    """Refuse, before tokenizing, text that cannot fit in --ctx: each token holds at most
    `longest_token_chars` characters, so C characters of message text are at least
    C / longest_token_chars tokens (a multi-megabyte prompt is refused at once)."""
    chars, todo = 0, list(parts)
    while todo:
        node = todo.pop()
        if isinstance(node, str):
            chars += len(node)
        elif isinstance(node, dict):
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    at_least = chars // srv.tok.longest_token_chars
    if at_least > srv.ctx:
        raise ApiError(400, f"the prompt is at least {at_least} tokens ({chars} characters) and the server's --ctx is"
                       f" {srv.ctx}; shorten the conversation or restart the server with a larger --ctx",
                       code="context_length_exceeded")  # fmt: skip


def depth(obj: Any) -> int:
    """Nesting depth of parsed JSON, without recursion (1 for a flat object)."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        node, d = todo.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            deepest = max(deepest, d)
            todo.extend((child, d + 1) for child in node if isinstance(child, (dict, list)))
    return deepest


def validate(model: type[M], body: dict[str, Any]) -> M:
    """`body` checked against `model`; the first problem as a 400 that names the field (a field
    this server does not read included: nothing is ignored)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        # a field we do not read says more than the type errors pydantic found beside it
        first = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
        where = ".".join(str(p) for p in first["loc"]) or "body"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        if first["type"] == "extra_forbidden":
            name = str(first["loc"][-1])
            why = REFUSED.get(name, "not a field this server reads")
            message = f"{where}: not supported here ({why}); docs/serving.md lists the fields of each endpoint"
            raise ApiError(400, message, code="unsupported_field", param=where) from None
        msg = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{where}: {msg}{more}", code="invalid_field", param=where) from None


def build(make: Callable[[], Prompt]) -> Prompt:
    try:
        return make()
    except Dsv4Error as e:
        raise ApiError(400, str(e), code=getattr(e, "code", None) or "invalid_request") from None


class _Events:
    """Engine thread -> event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def emit(self, kind: str, payload: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    async def next(self, timeout: float) -> tuple[str, Any] | None:
        try:
            return await asyncio.wait_for(self.q.get(), timeout)
        except TimeoutError:
            return None


def make_job(
    srv: ServerState, prompt: Prompt, requested: int | None, req, top_logprobs: int | None = None,
    grammar: Shape | None = None,
) -> tuple[Job, _Events]:  # fmt: skip
    try:
        budget = max_new_tokens(requested, len(prompt.ids), srv.ctx)
    except Dsv4Error as e:
        raise ApiError(400, str(e), code="context_length_exceeded") from None
    thinking = getattr(req, "thinking", None)
    controls = Controls(
        logit_bias(srv, req.logit_bias), req.frequency_penalty or 0.0, req.presence_penalty or 0.0, top_logprobs,
        grammar, thinking.budget_tokens if thinking is not None else None,
    )  # fmt: skip
    events = _Events()

    def reply() -> ReplyStream:
        parallel = getattr(req, "parallel_tool_calls", None) is not False
        return ReplyStream(
            srv.tok, thinking=prompt.thinking, tools=prompt.tools, stops=prompt.stops, parallel=parallel,
            grammar=prompt.grammar,
        )  # fmt: skip

    job = Job(list(prompt.ids), budget, sampling(req), reply(), events.emit, controls=controls,
              more_replies=[reply() for _ in range(req.n - 1)], grammars=srv.grammars, thinking=prompt.thinking)  # fmt: skip
    return job, events


def logit_bias(srv: ServerState, bias: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and int(key) < srv.tok.n_tokens):
            raise ApiError(400, f"logit_bias: {key!r} is not a token id (0..{srv.tok.n_tokens - 1})",
                           code="invalid_field", param="logit_bias")  # fmt: skip
        out[int(key)] = value
    return out


async def wait_done(job: Job, events: _Events, request: Request) -> list[Outcome]:
    try:
        while True:
            ev = await events.next(0.5)
            if ev is None:
                if await request.is_disconnected():
                    raise ApiError(499, "client closed the request", code="client_gone")
                continue
            kind, payload = ev
            if kind == "done":
                return payload
            if kind == "error":
                raise engine_error(payload)
    finally:
        job.cancelled.set()


def engine_error(e: BaseException) -> ApiError:
    """What the client is told of a failure in the engine thread: requests were checked before
    they were queued, so it is the server's (500); a programming error's traceback stays in the log."""
    if isinstance(e, Dsv4Error):
        return ApiError(500, str(e), "server_error", code="engine_error")
    return ApiError(500, f"internal error ({type(e).__name__}); see the server log", "server_error")


# ---- responses -------------------------------------------------------------------------------


@dataclass
class _Meta:
    prefix: str
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        # OpenAI's chat and completion ids use a dash (chatcmpl-...), Responses and Anthropic ids an underscore
        sep = "_" if self.prefix in ("resp", "msg") else "-"
        self.id = f"{self.prefix}{sep}{secrets.token_hex(12)}"
        self.created = int(time.time())

    def call_id(self, i: int) -> str:
        return f"call_{self.id[-12:]}_{i}"

    def body(self, obj: str, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        out["choices"] = choices
        if usage is not None:
            out["usage"] = usage_json(usage)
        return out


def chat_body(
    meta: _Meta, outcomes: list[Outcome], thinking: bool, usage: Usage, lp_tok: Tokenizer | None = None
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
    return meta.body("chat.completion", choices, usage)


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


def sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def job_events(job: Job, events: _Events, keepalive: float) -> AsyncIterator[tuple[str, Any]]:
    """The job's events, with ("comment", text) when nothing came for `keepalive` seconds;
    cancels the job when the consumer stops early (the client went away)."""
    try:
        while True:
            ev = await events.next(keepalive)
            if ev is None:
                yield "comment", "keep-alive"
                continue
            yield ev
            if ev[0] in ("done", "error"):
                return
    finally:
        job.cancelled.set()


def stream_error(e: BaseException) -> str:
    """An engine failure in the middle of an OpenAI chat or completion stream: a `data:` line
    holding OpenAI's error body (the client raises it), then the stream's end."""
    a = engine_error(e)
    return _data(error_body(a.message, a.kind, a.code))


async def chat_chunks(job: Job, events: _Events, meta: _Meta, keepalive: float) -> AsyncIterator[str]:
    lp_tok = job.reply.tok if job.controls.top_logprobs is not None else None

    def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0, lp: list | None = None) -> str:
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
        if lp_tok is not None:
            choice["logprobs"] = {"content": logprob_json(lp_tok, lp or []), "refusal": None} if lp else None
        return _data(meta.body("chat.completion.chunk", [choice]))

    for i in range(len(job.replies)):  # content null, as llama.cpp and OpenAI (before a tool call) send it
        yield chunk({"role": "assistant", "content": None}, index=i)
    calls = 0
    async for kind, payload in job_events(job, events, keepalive):
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
                yield _data(meta.body("chat.completion.chunk", [], job.usage))
            yield "data: [DONE]\n\n"
        elif kind == "error":
            yield stream_error(payload)
            yield "data: [DONE]\n\n"


async def _completion_chunks(
    job: Job, events: _Events, meta: _Meta, keepalive: float, lp_tok: Tokenizer | None = None
) -> AsyncIterator[str]:
    offsets = [0] * len(job.replies)

    def chunk(text: str, finish: str | None = None, index: int = 0, lp: list | None = None) -> str:
        logprobs = legacy_logprobs(lp_tok, lp or [], offsets[index]) if lp_tok is not None and lp else None
        offsets[index] += len(text)
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return _data(meta.body("text_completion", [choice]))

    async for kind, payload in job_events(job, events, keepalive):
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
                yield _data(meta.body("text_completion", [], job.usage))
            yield "data: [DONE]\n\n"
        elif kind == "error":
            yield stream_error(payload)
            yield "data: [DONE]\n\n"


# ---- access log ------------------------------------------------------------------------------


class AccessLog:
    """ASGI middleware: one line per request once its response has been sent (or abandoned);
    successful GETs of the page, its files, /health and /v1/stats are not logged."""

    def __init__(self, app, log: Log) -> None:
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), [0]
        scope.setdefault("state", {})

        async def send_(msg) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_)
        finally:
            if not (status[0] == 200 and scope["method"] == "GET" and _quiet(scope["path"])):
                self.log(access_line(scope, status[0], time.perf_counter() - t0, scope["state"].get("usage")))


def _quiet(path: str) -> bool:
    """Polled or static: the chat page asks for /v1/stats every second, its picture while it answers."""
    return path in ("/", "/health", "/v1/stats", "/v1/page/info", "/v1/page/experts") or path.startswith("/static/")


def access_line(scope, status: int, seconds: float, usage: Usage | None) -> str:
    client = scope.get("client") or ("-", 0)
    line = f'{client[0]} "{scope["method"]} {scope["path"]}" {status or "-"} {seconds:.2f} s'
    if usage is not None and usage.prompt_tokens:
        rate = usage.completion_tokens / usage.decode_seconds if usage.decode_seconds else 0.0
        src = f", {usage.cache_source}" if usage.cache_source else ""
        line += (
            f"; prompt {usage.prompt_tokens} tokens (cached {usage.cached_tokens}{src}),"
            f" generated {usage.completion_tokens} in {usage.seconds:.2f} s (queued {usage.queued_seconds:.2f} s),"
            f" prefill {usage.prefill_seconds:.2f} s, {rate:.1f} tokens/s"
        )
    if status == 0:
        line += "; client gone"
    return line
