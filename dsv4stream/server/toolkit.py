"""What every family of routes shares: the server's state, errors, reading and checking a
request, queueing its job, waiting on it, Server-Sent Events and the access log.

Owns: `ServerState` (what the routes share), `ApiError` (a 4xx/5xx the app's handler turns
into the error shape of the API the path belongs to, `errors`), reading a body (size limit,
JSON, nesting depth; parsed in a worker thread, so a large request never holds up the event
loop and /health stays fast), checking it against a `schemas` model (the first problem as a
400 naming the field), turning a `Prompt` into a `Job` and queueing it (429 when the queue is
full), waiting on its events (`: keep-alive` while nothing comes; a client that goes away
cancels its job: the engine stops at the next token or prefill chunk), and `AccessLog`, one
line per request. Each API's shapes are its own module's (`openai`, `anthropic`,
`responses`); the app is assembled in `app`. No model logic here: handlers talk to the
`Worker` through jobs only.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from ..errors import Dsv4Error, UsageError
from ..text import chat
from ..text.tokenizer import Tokenizer
from .decoding import Controls
from .grammar import Grammars, Shape
from .images import ImagePolicy
from .metrics import Metrics
from .prompt import Prompt, max_new_tokens, sampling
from .reply import Outcome, ReplyStream
from .schemas import REFUSED
from .worker import Job, Usage, Worker

Log = Callable[[str], None]
MAX_DEPTH = 100  # nesting of a request body: far past any tool schema, far below Python's recursion limit
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
IMAGE_PARTS = ("image_url", "image", "input_image")  # OpenAI chat's, Anthropic's and Responses' image parts


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
    images: ImagePolicy | None = None  # V4.1 image parts: the checkpoint's vision config, --allow-image-urls

    def __post_init__(self) -> None:
        self.grammars = Grammars(self.tok, max(self.tok.vocab_size, self.tok.n_tokens))


class ApiError(Exception):
    """A request the server answers with an error: `create_app`'s handler writes it in the shape
    of the API the path belongs to (`errors.error_json`)."""

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


# ---- requests --------------------------------------------------------------------------------


def ready(srv: ServerState) -> Worker:
    if srv.worker is None:
        raise ApiError(503, "the model is still loading; retry when GET /health answers 200", "server_error", "loading",
                       headers={"Retry-After": "5"})  # fmt: skip
    return srv.worker


def submit(srv: ServerState, worker: Worker, job: Job) -> None:
    """Queue the job, or 429 when --max-queue requests already wait."""
    if worker.ahead > srv.max_queue:  # it would wait behind max_queue others (a full batch counting one)
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
            if node.get("type") not in IMAGE_PARTS:  # an image's base64 is no text: its span is counted later
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


def validate(model: type[M], body: dict[str, Any], renames: tuple[tuple[str, str], ...] = ()) -> M:
    """`body` checked against `model`; the first problem as a 400 that names the field (a field
    this server does not read included: nothing is ignored). `renames`: (regex, replacement)
    pairs that turn a field of `body` into the client's name for it, where `body` is another
    API's request translated (the Anthropic `stop_sequences` checked as OpenAI's `stop`)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        # a field we do not read says more than the type errors pydantic found beside it; among
        # a union's alternatives, the one that went deepest into the value says what is wrong
        first = next((x for x in errors if x["type"] == "extra_forbidden"), None)
        if first is None:
            first = max(errors, key=lambda x: len(field_path(x["loc"], body, x["type"])))
        path = field_path(first["loc"], body, first["type"])
        msg = first["msg"].removeprefix("Value error, ")
        # a rule between an object's fields says which one it is about: "top_logprobs: needs ..."
        named = re.match(r"([a-z_]+): ", msg)
        if named and first["type"] == "value_error" and named[1] in at(body, path):
            path, msg = [*path, named[1]], msg[named.end() :]
        where = ".".join(str(p) for p in path) or "body"
        for pattern, name in renames:
            where = re.sub(pattern, name, where)
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        if first["type"] == "extra_forbidden":
            name = str(first["loc"][-1])
            why = REFUSED.get(name, "not a field this server reads")
            message = f"{where}: not supported here ({why}); docs/serving.md lists the fields of each endpoint"
            raise ApiError(400, message, code="unsupported_field", param=where) from None
        raise ApiError(400, f"{where}: {msg}{more}", code="invalid_field", param=where) from None


def at(body: Any, path: list) -> Any:
    """The JSON value at `path` (one `field_path` returned): {} where it is no object."""
    for step in path:
        body = body[step]
    return body if isinstance(body, dict) else {}


def field_path(loc: tuple, body: Any, kind: str) -> list:
    """The JSON path of a pydantic error's location: the keys and indices that lead into `body`.
    The rest are pydantic's names for a union's alternatives (`str`, `list[...]`, `type=text`),
    which the client never wrote; a missing field's name is kept at the end."""
    path, node = [], body
    for i, step in enumerate(loc):
        key = isinstance(node, dict) and isinstance(step, str) and step in node
        if key or (isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node)):
            path.append(step)
            node = node[step]
        elif i == len(loc) - 1 and kind == "missing":
            path.append(step)
    return path


def build(make: Callable[[], T]) -> T:
    """`make()`, a Dsv4Error from it a 400 (its `code` and `param` when it names them)."""
    try:
        return make()
    except Dsv4Error as e:
        code, param = getattr(e, "code", None) or "invalid_request", getattr(e, "param", None)
        raise ApiError(400, str(e), code=code, param=param) from None


class Events:
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
    grammar: Shape | None = None, speculate: str | int | None = None,
) -> tuple[Job, Events]:  # fmt: skip
    """The worker's job for a request; `speculate`: the request's own field where its body is not
    `req` (Anthropic, Responses), else `req.speculate`."""
    try:
        budget = max_new_tokens(requested, len(prompt.ids), srv.ctx)
    except Dsv4Error as e:
        raise ApiError(400, str(e), code="context_length_exceeded") from None
    speculate = getattr(req, "speculate", None) if speculate is None else speculate
    if speculate is not None and srv.worker is not None:
        try:  # against the checkpoint: a drafter to run, a draft length it drafts
            speculate = srv.worker.rt.speculator.resolve(speculate, "speculate")
        except UsageError as e:
            raise ApiError(400, str(e), code="invalid_field", param="speculate") from None
    thinking = getattr(req, "thinking", None)
    controls = Controls(
        logit_bias(srv, req.logit_bias), req.frequency_penalty or 0.0, req.presence_penalty or 0.0, top_logprobs,
        grammar, thinking.budget_tokens if thinking is not None else None,
    )  # fmt: skip
    events = Events()

    def reply() -> ReplyStream:
        parallel = getattr(req, "parallel_tool_calls", None) is not False
        return ReplyStream(
            srv.tok, thinking=prompt.thinking, tools=prompt.tools, stops=prompt.stops, parallel=parallel,
            grammar=prompt.grammar,
        )  # fmt: skip

    job = Job(list(prompt.ids), budget, sampling(req), reply(), events.emit, controls=controls,
              more_replies=[reply() for _ in range(req.n - 1)], grammars=srv.grammars, thinking=prompt.thinking,
              images=prompt.images, speculate=speculate)  # fmt: skip
    return job, events


def logit_bias(srv: ServerState, bias: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        # the length first: int() of thousands of digits is refused by Python itself (a 500)
        if not (key.isascii() and key.isdigit() and len(key) <= 12 and int(key) < srv.tok.n_tokens):
            raise ApiError(400, f"logit_bias: {key[:20]!r} is not a token id (0..{srv.tok.n_tokens - 1})",
                           code="invalid_field", param="logit_bias")  # fmt: skip
        out[int(key)] = value
    return out


GONE_POLL = 0.25  # seconds between looks for a vanished client while a non-streamed answer is made


async def wait_done(job: Job, events: Events, request: Request) -> list[Outcome]:
    """The job's outcomes once it is done. The client is looked for every GONE_POLL seconds
    whether or not events flow (they do for every token: looking only when none came let an
    abandoned n=16 request run to its end); once it is gone the job is cancelled."""
    loop = asyncio.get_running_loop()
    look_at = loop.time() + GONE_POLL
    try:
        while True:
            ev = await events.next(GONE_POLL)
            if loop.time() >= look_at:
                if await request.is_disconnected():
                    raise ApiError(499, "client closed the request", code="client_gone")
                look_at = loop.time() + GONE_POLL
            if ev is None:
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


# ---- events and SSE ----------------------------------------------------------------------------


@dataclass
class Meta:
    """One answer's id, creation time and model, in every API's shape; tool-call ids derive from the id."""

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


def sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)


async def job_events(job: Job, events: Events, keepalive: float) -> AsyncIterator[tuple[str, Any]]:
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
        if usage.batch_passes:
            line += f", decoded with {usage.mean_batch:.1f} requests a pass"
    if status == 0:
        line += "; client gone"
    return line
