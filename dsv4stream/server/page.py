"""What the chat page at `/` needs beyond the OpenAI API: small read-only routes under
`/v1/page/` (so the API key guards them like the rest of /v1/), and the SSE comments that
carry the page's per-answer figures.

Owns: `GET /v1/page/info` (model, --ctx, the chat format's reasoning-effort range, whether
the model reads images, the
model's shape for the expert picture), `POST /v1/page/tokens` (`TokensRequest`: token count of a text the
user is about to send, e.g. a dropped file; tokenized off the event loop),
`GET /v1/page/experts` (which (layer, expert) pairs hold a cache slot, most recently used
first), and `page_comment`, which turns the worker's "queued" / "sample" / "summary"
events into `: dsv4 {...}` SSE comment lines. SSE clients (the openai and anthropic SDKs
among them) skip comment lines, so the OpenAI shapes are unchanged.
Not here: the page itself (static/), the chat API (`openai`), the figures (`stats`).
"""

from __future__ import annotations

import json
from numbers import Integral
from typing import Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from ..text import chat
from .schemas import _Body
from .toolkit import ApiError, ServerState, read_body, validate

PAGE_EVENTS = ("queued", "sample", "summary")


class TokensRequest(_Body):
    """`POST /v1/page/tokens`: the text to count, nothing else."""

    text: str


def page_comment(kind: str, payload: object) -> str:
    """One SSE comment line with a page event: `: dsv4 {"sample": {...}}`."""
    return f": dsv4 {json.dumps({kind: payload}, separators=(',', ':'))}\n\n"


def effort_range(encoder: str) -> dict[str, Any]:
    """The reasoning efforts of the checkpoint's chat format, as the server's `reasoning_effort`
    accepts them: V4's named levels (its default first), or V4.1's numeric range with the
    number each name stands for (`chat.effort_choices`)."""
    choices = chat.effort_choices(encoder)
    if choices["range"] is None:
        return {"kind": "levels", "values": choices["names"], "default": choices["default"]}
    low, high = choices["range"]
    named = choices["values"]
    return {"kind": "range", "min": low, "max": high, "default": named[choices["default"]], "named": dict(named)}


def add_routes(app: FastAPI, srv: ServerState) -> None:
    @app.get("/v1/page/info")
    async def info() -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": srv.model,
            "ctx": srv.ctx,
            "chat_format": srv.encoder,
            "reasoning_effort": effort_range(srv.encoder),
            "max_body_bytes": srv.max_body,
            "images": srv.images is not None and srv.images.vision is not None,  # V4.1 with a vision tower
            "ready": srv.worker is not None,
        }
        if srv.worker is not None:
            cfg = srv.worker.rt.cfg
            out["layers"], out["experts"] = cfg.n_layers, cfg.n_routed_experts
            out["experts_per_token"] = cfg.num_experts_per_tok
            out["slots"] = srv.worker.rt.store.slots
        return out

    @app.post("/v1/page/tokens")
    async def tokens(request: Request) -> dict[str, int]:
        body = await read_body(request, srv)  # no model needed: the tokenizer is loaded first
        if not isinstance(body.get("text"), str):
            raise ApiError(400, "text: give the text to count as a JSON string", code="invalid_field", param="text")
        text = validate(TokensRequest, body).text  # and nothing else
        n = await run_in_threadpool(lambda: len(srv.tok.encode(text)))
        return {"tokens": n, "characters": len(text)}

    @app.get("/v1/page/experts")
    async def experts() -> dict[str, Any]:
        worker = srv.worker
        if worker is None:
            raise ApiError(503, "the model is still loading; retry when GET /health answers 200", "server_error",
                           "loading")  # fmt: skip
        cfg, store = worker.rt.cfg, worker.rt.store
        keys = store.resident()  # a copy under the store's lock; the engine thread goes on
        cells = [[int(k[0]), int(k[1])] for k in reversed(keys) if _expert_key(k, cfg.n_layers, cfg.n_routed_experts)]
        return {
            "layers": cfg.n_layers,
            "experts": cfg.n_routed_experts,
            "slots": store.slots,
            # one token's forward pass asks for this many: the most recent ones are "hot"
            "per_token": cfg.n_layers * cfg.num_experts_per_tok,
            "resident": cells,
        }


def _expert_key(key: object, layers: int, experts: int) -> bool:
    """A main layer's routed expert (the store may also hold other keys, e.g. the MTP block's)."""
    return (
        isinstance(key, tuple)
        and len(key) == 2
        and all(isinstance(v, Integral) for v in key)
        and 0 <= key[0] < layers
        and 0 <= key[1] < experts
    )
