"""The HTTP layer: FastAPI routes in OpenAI's shapes, Server-Sent Events, errors, access log.

Owns: reading and checking a request (size limit, JSON, `schemas`), turning it into a
`Job` (`prompt`), and writing what the engine thread reports back: a JSON body, or SSE
chunks (one per token that adds text; `: keep-alive` comments while the request waits in
the queue or a long prefill runs; `data: [DONE]` at the end). Errors are OpenAI's
`{"error": {"message", "type", "param", "code"}}` with 400 / 401 / 413 / 503 / 500; a
stack trace only goes to the server log. A client that goes away cancels its job: the
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

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ValidationError

from ..errors import Dsv4Error
from ..text import chat
from ..text.chat import ToolCall
from ..text.tokenizer import Tokenizer
from .prompt import Prompt, chat_prompt, completion_prompt, max_new_tokens, sampling
from .reply import Delta, Outcome, ReplyStream
from .schemas import ChatRequest, CompletionRequest
from .worker import Job, Usage, Worker

Log = Callable[[str], None]
STATIC = Path(__file__).with_name("static")  # the chat page: plain HTML/JS/CSS, no build step
M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerState:
    """What the routes share; `worker` is None until the model is loaded."""

    model: str
    tok: Tokenizer
    ctx: int
    log: Log
    api_key: str | None = None
    encoder: str = chat.LATEST  # the checkpoint's chat-format release (reasoning effort)
    keepalive: float = 10.0  # seconds between SSE comments while nothing else is sent
    max_body: int = 8 * 1024 * 1024
    worker: Worker | None = None
    started: float = field(default_factory=time.time)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def create_app(srv: ServerState) -> FastAPI:
    app = FastAPI(title="dsv4stream", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.srv = srv

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.kind, e.code), status_code=e.status)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        body = error_body(f"internal error ({type(e).__name__}); see the server log", "server_error")
        return JSONResponse(body, status_code=500)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if srv.api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            given = given or request.headers.get("x-api-key", "")
            if not secrets.compare_digest(given.encode(), srv.api_key.encode()):
                body = error_body("missing or wrong API key (Authorization: Bearer KEY)", "authentication_error")
                return JSONResponse(body, status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        if srv.worker is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok", "model": srv.model, "queued": srv.worker.queued})

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        worker = srv.worker
        if worker is None:
            return {"model": srv.model, "phase": "loading"}
        return {"model": srv.model, "ctx": srv.ctx, **worker.stats.snapshot(worker.queued)}

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": srv.model, "object": "model", "created": int(srv.started), "owned_by": "dsv4stream"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, worker = await read_body(request, srv)
        req = validate(ChatRequest, body)
        prompt = build(lambda: chat_prompt(srv.tok, req, body, srv.encoder))
        job, events = make_job(srv, prompt, req.max_completion_tokens or req.max_tokens, req)
        request.state.usage = job.usage
        worker.submit(job)
        meta = _Meta("chatcmpl", srv.model, include_usage=bool(req.stream_options and req.stream_options.include_usage))
        if req.stream:
            return sse_response(chat_chunks(job, events, meta, srv.keepalive))
        outcome = await wait_done(job, events, request)
        return chat_body(meta, outcome, prompt.thinking, job.usage)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, worker = await read_body(request, srv)
        req = validate(CompletionRequest, body)
        prompt = build(lambda: completion_prompt(srv.tok, req))
        job, events = make_job(srv, prompt, req.max_tokens, req)
        request.state.usage = job.usage
        worker.submit(job)
        meta = _Meta("cmpl", srv.model, include_usage=bool(req.stream_options and req.stream_options.include_usage))
        if req.stream:
            return sse_response(_completion_chunks(job, events, meta, srv.keepalive))
        outcome = await wait_done(job, events, request)
        choice = {"index": 0, "text": outcome.content, "finish_reason": outcome.finish_reason, "logprobs": None}
        return meta.body("text_completion", [choice], job.usage)

    from .anthropic import add_routes

    add_routes(app, srv)
    return app


# ---- requests --------------------------------------------------------------------------------


async def read_body(request: Request, srv: ServerState) -> tuple[dict[str, Any], Worker]:
    worker = srv.worker
    if worker is None:
        raise ApiError(503, "the model is still loading; retry when GET /health answers 200", "server_error", "loading")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > srv.max_body:
        raise ApiError(413, f"request body of {declared} bytes is over the limit of {srv.max_body}", code="too_large")
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > srv.max_body:
            raise ApiError(413, f"request body is over the limit of {srv.max_body} bytes", code="too_large")
        chunks.append(part)
    try:
        body = json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return body, worker


def validate(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise ApiError(400, f"{where}: {first['msg']}{more}", code="invalid_field") from None


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


def make_job(srv: ServerState, prompt: Prompt, requested: int | None, req) -> tuple[Job, _Events]:
    try:
        n = max_new_tokens(requested, len(prompt.ids), srv.ctx)
    except Dsv4Error as e:
        raise ApiError(400, str(e), code="context_length_exceeded") from None
    events = _Events()
    reply = ReplyStream(
        srv.tok, thinking=prompt.thinking, tools=prompt.tools, stops=prompt.stops, grammar=prompt.grammar
    )
    return Job(list(prompt.ids), n, sampling(req), reply, events.emit), events


async def wait_done(job: Job, events: _Events, request: Request) -> Outcome:
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
                _raise(payload)
    finally:
        job.cancelled.set()


def _raise(e: BaseException):
    # requests were checked before they were queued: what fails in the engine is the server's
    if isinstance(e, Dsv4Error):
        raise ApiError(500, str(e), "server_error", code="engine_error")
    raise ApiError(500, f"internal error ({type(e).__name__}); see the server log", "server_error")


# ---- responses -------------------------------------------------------------------------------


@dataclass
class _Meta:
    prefix: str
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = f"{self.prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())

    def call_id(self, i: int) -> str:
        return f"call_{self.id[-12:]}_{i}"

    def body(self, obj: str, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        out["choices"] = choices
        if usage is not None:
            out["usage"] = usage_json(usage)
        return out


def chat_body(meta: _Meta, outcome: Outcome, thinking: bool, usage: Usage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": outcome.content or None}
    if thinking:
        message["reasoning_content"] = outcome.reasoning
    if outcome.tool_calls:
        message["tool_calls"] = [_call_json(c, meta.call_id(i)) for i, c in enumerate(outcome.tool_calls)]
    choice = {"index": 0, "message": message, "finish_reason": outcome.finish_reason, "logprobs": None}
    return meta.body("chat.completion", [choice], usage)


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
    try:
        _raise(e)
    except ApiError as a:
        return _data(error_body(a.message, a.kind, a.code))
    return ""


async def chat_chunks(job: Job, events: _Events, meta: _Meta, keepalive: float) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return _data(meta.body("chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": finish}]))

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    async for kind, payload in job_events(job, events, keepalive):
        if kind == "comment":
            yield f": {payload}\n\n"
        elif kind == "progress":
            yield f": prefill {payload[0]}/{payload[1]}\n\n"
        elif kind == "delta":
            d: Delta = payload
            if d.reasoning:
                yield chunk({"reasoning_content": d.reasoning})
            if d.content:
                yield chunk({"content": d.content})
            for c in d.tool_calls:
                yield chunk({"tool_calls": [_call_json(c, meta.call_id(calls), index=calls)]})
                calls += 1
        elif kind == "done":
            yield chunk({}, payload.finish_reason)
            if meta.include_usage:
                yield _data(meta.body("chat.completion.chunk", [], job.usage))
            yield "data: [DONE]\n\n"
        elif kind == "error":
            yield stream_error(payload)
            yield "data: [DONE]\n\n"


async def _completion_chunks(job: Job, events: _Events, meta: _Meta, keepalive: float) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None = None) -> str:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return _data(meta.body("text_completion", [choice]))

    async for kind, payload in job_events(job, events, keepalive):
        if kind == "comment":
            yield f": {payload}\n\n"
        elif kind == "progress":
            yield f": prefill {payload[0]}/{payload[1]}\n\n"
        elif kind == "delta" and payload.content:
            yield chunk(payload.content)
        elif kind == "done":
            yield chunk("", payload.finish_reason)
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
    """Polled or static: the chat page asks for /v1/stats every second."""
    return path in ("/", "/health", "/v1/stats") or path.startswith("/static/")


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
