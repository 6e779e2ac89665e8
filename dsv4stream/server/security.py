"""Who may talk to the local server: Host, Origin, CORS, content type and the API key.

Owns: `Policy` (what `dsv4 serve`'s options allow) and `Guard`, the ASGI middleware that
checks every HTTP request before any route runs, in this order:

1. Host (DNS rebinding): on a loopback bind only `localhost`, `127.0.0.1` and `[::1]` (any
   port) plus `--allowed-host` names are served; a page on `evil.example` that re-points its
   name at 127.0.0.1 sends `Host: evil.example` and gets 403. `--allowed-host` applies to
   any bind when given.
2. Origin (cross-site requests): a browser names the page that makes a request. The
   server's own origin (`http://` + the Host header, i.e. the chat page) always passes;
   any other origin needs `--cors-origin` (a list, or `*`), else 403. Clients that are not
   browsers send no Origin and pass.
3. CORS preflight (`OPTIONS` with `Access-Control-Request-Method`) from an allowed origin:
   200 (as llama.cpp's server and Starlette's CORS middleware answer; any 2xx will do for a
   browser) with the allowed methods and headers, without the API key (browsers never send it
   on a preflight). Answers to allowed cross-origin requests carry the CORS headers.
4. `POST` bodies must say `Content-Type: application/json` (415): the content types a page
   may send cross-site without a preflight (text/plain, forms) never reach a route.
5. The API key, when set, on /v1/* and /metrics: `Authorization: Bearer KEY` or
   `x-api-key: KEY`, compared in constant time (HMAC digests of equal length).

Refusals use the error shape of the API the path belongs to (`errors`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from .errors import error_json

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
ALLOWED_METHODS = "GET, POST, OPTIONS"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The name part of a Host header: `[::1]:8000` -> `[::1]`, `LocalHost:80` -> `localhost`."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[: end + 1] if end > 0 else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass(frozen=True)
class Policy:
    api_key: str | None = None
    loopback: bool = True  # bound to a loopback address: Host is checked
    allowed_hosts: tuple[str, ...] = ()  # --allowed-host: more names served ("*": any)
    cors_origins: tuple[str, ...] = ()  # --cors-origin: origins allowed cross-site ("*": any)
    _key_digest: bytes = field(default=b"", init=False, repr=False)

    def __post_init__(self) -> None:
        if self.api_key is not None:
            object.__setattr__(self, "_key_digest", _digest(self.api_key.encode()))

    def host_ok(self, host: str | None) -> bool:
        if host is None:  # HTTP/1.0 without Host: not a browser
            return True
        if "*" in self.allowed_hosts:
            return True
        if not (self.loopback or self.allowed_hosts):  # bound to a public address and no list: any name
            return True
        name = host_name(host)
        return name in LOOPBACK_NAMES or name in self.allowed_hosts

    def cross_origin_ok(self, origin: str) -> bool:
        return "*" in self.cors_origins or origin.rstrip("/").lower() in self.cors_origins

    def key_ok(self, given: bytes) -> bool:
        return hmac.compare_digest(_digest(given), self._key_digest)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(b"dsv4-api-key\0" + key).digest()


def normalize_origins(values: Iterable[str]) -> tuple[str, ...]:
    """`--cors-origin` values: `*`, or origins `scheme://host[:port]`, several per option
    separated by commas; anything else is refused (the caller turns ValueError into one line)."""
    out: list[str] = []
    for value in values:
        for item in value.split(","):
            item = item.strip().rstrip("/").lower()
            if not item:
                continue
            if item != "*" and (
                "://" not in item or item.split("://", 1)[1] in ("", "*") or "/" in item.split("://")[1]
            ):
                raise ValueError(f"{item!r} is not an origin (scheme://host[:port], e.g. http://localhost:3000) or *")
            out.append(item)
    return tuple(out)


# Clients configured with the server's root as their base URL (llama.cpp's server answers there too)
# call these without /v1; they are the /v1 routes, nothing else is aliased.
UNPREFIXED = ("/models", "/chat/completions", "/completions", "/responses", "/messages", "/messages/count_tokens")


def v1_alias(path: str) -> str | None:
    """The /v1 path an un-prefixed API path stands for, or None."""
    if path in UNPREFIXED or path.startswith("/models/"):
        return "/v1" + path
    return None


class Guard:
    """ASGI middleware applying `Policy` to every HTTP request (see the module docstring)."""

    def __init__(self, app, policy: Policy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (alias := v1_alias(scope["path"])) is not None:  # before the checks: the key guards it like /v1/*
            scope = {**scope, "path": alias, "raw_path": alias.encode("latin-1")}
        headers = _headers(scope)
        path, method = scope["path"], scope["method"]
        p = self.policy
        if not p.host_ok(headers.get("host")):
            await _refuse(send, path, 403, "Host not allowed: this server answers to localhost, 127.0.0.1 and [::1]"
                          " (start it with --allowed-host NAME to add a name)", "permission_error", "host_not_allowed")  # fmt: skip
            return
        origin = headers.get("origin")
        cross = origin is not None and origin.rstrip("/").lower() != f"{scope.get('scheme', 'http')}://{headers.get('host', '')}".lower()  # fmt: skip
        if cross and not p.cross_origin_ok(origin):
            await _refuse(send, path, 403, f"Origin {origin!r} not allowed (start the server with --cors-origin"
                          " ORIGIN to let that site use it)", "permission_error", "origin_not_allowed")  # fmt: skip
            return
        if method == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
            await _preflight(send, origin, headers.get("access-control-request-headers", ""))
            return
        if method == "POST":
            ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                shown = ctype or "none"
                await _refuse(send, path, 415, f"Content-Type {shown} is not accepted: send the body as JSON with"
                              " Content-Type: application/json", "invalid_request_error", "unsupported_media_type")  # fmt: skip
                return
        if p.api_key is not None and (path.startswith("/v1/") or path == "/metrics"):
            given = headers.get("authorization", "")
            given = given[7:].strip() if given[:7].lower() == "bearer " else headers.get("x-api-key", "")
            if not p.key_ok(given.encode("latin-1")):
                await _refuse(send, path, 401, "missing or wrong API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                              "authentication_error", "invalid_api_key")  # fmt: skip
                return
        if cross:
            send = _with_cors(send, origin)
        await self.app(scope, receive, send)


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def _refuse(send, path: str, status: int, message: str, kind: str, code: str) -> None:
    body = json.dumps(error_json(path, message, kind, code, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"vary", b"Origin"),
        (b"access-control-expose-headers", b"Retry-After, X-Request-Id"),
    ]


async def _preflight(send, origin: str, asked_headers: str) -> None:
    headers = [
        *_cors_headers(origin),
        (b"access-control-allow-methods", ALLOWED_METHODS.encode()),
        (b"access-control-max-age", b"600"),
        (b"content-length", b"0"),
    ]
    if asked_headers:
        headers.append((b"access-control-allow-headers", asked_headers.encode("latin-1")))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


def _with_cors(send, origin: str):
    async def send_(msg) -> None:
        if msg["type"] == "http.response.start":
            msg = {**msg, "headers": [*msg.get("headers", []), *_cors_headers(origin)]}
        await send(msg)

    return send_
