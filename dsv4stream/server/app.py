"""The FastAPI app, assembled: error handlers, the server's own routes, and each API's routes.

Owns: turning an `ApiError`, a routing error (404 / 405) or an unexpected exception into the
error shape of the API the path belongs to (`errors`; a stack trace only goes to the server
log), `/health`, `/v1/stats`, `/metrics`, the chat page at `/` and its files, and mounting
the routes of OpenAI's API (`openai`), Anthropic's (`anthropic`), Responses (`responses`) and
the page's (`page`). What they share (state, body reading, validation, jobs, SSE, the access
log) is `toolkit`'s; who may call at all (Host, Origin, content type, key) is `security`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from . import anthropic, openai, page, responses
from .errors import error_json
from .metrics import Metrics
from .toolkit import ApiError, ServerState

STATIC = Path(__file__).with_name("static")  # the chat page: plain HTML/JS/CSS, no build step


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
        return {"model": srv.model, "ctx": srv.ctx, **worker.stats.snapshot(worker.queued, worker.max_batch)}

    metrics = Metrics(srv)
    srv.metrics = metrics

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    openai.add_routes(app, srv)
    anthropic.add_routes(app, srv)
    responses.add_routes(app, srv)
    page.add_routes(app, srv)
    return app
