"""`dsv4 serve CHECKPOINT`: the OpenAI-compatible HTTP server.

Owns: the options (checked before anything slow starts), binding the socket first (a port
in use is one line, exit 2), loading the model in the background while `/health` answers
"loading", the plan on stderr, then `listening on http://HOST:PORT`; the prefix caches'
sizes (`--keep-states` states in RAM, counted in the plan; `--kv-cache DIR` on disk up to
`--kv-cache-gb`), who may call (`--api-key`, `--cors-origin`, `--allowed-host`: see
`server.security`), the limits on clients (`--max-queue`, `--max-connections`, header and
body timeouts: `server.transport`), and shutting down cleanly on Ctrl-C / SIGTERM. The
HTTP layer is `dsv4stream.server`.
"""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import threading
from dataclasses import replace
from pathlib import Path

import click

from .. import gpu
from ..checkpoint.config import ModelConfig
from ..engine.numerics import RUN_DEFAULT
from ..errors import BudgetError, UsageError
from ..run import planner
from ..run.memory import DEFAULT_MAX_BATCH, max_batch_for
from ..run.runinfo import RunOptions
from ..run.runtime import Runtime
from ..server.security import is_loopback
from ..text import chat
from ..text.sampler import banned_ids
from .budget import budget_bytes
from .numerics_option import numerics_option
from .run import check_trunk, checkpoint_dir, load_tokenizer, speculate_setting

# FastAPI, pydantic, uvicorn and the event loop on top of what `dsv4 run` holds: peak RSS of
# `dsv4 serve` after three streamed requests minus that of the same `dsv4 run` on the tiny
# test checkpoint (270.5 MB vs 222.1 MB, python 3.11), plus a margin.
SERVER_OVERHEAD = 60 * 1000 * 1000


def _say(msg: str) -> None:
    click.echo(msg, err=True)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(
            f"--host {host} --port {port}: cannot listen there ({e.strerror}); pick another --port"
        ) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


@click.command("serve")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port.")
@click.option("--api-key", default=None, help="Require `Authorization: Bearer KEY` on /v1/ endpoints and /metrics.")
@click.option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    help="Let web pages of this origin (scheme://host[:port]; repeat, or comma-separated; * for any) call the API.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    help="Also answer requests whose Host is this name (repeatable; * for any). On loopback only localhost,"
    " 127.0.0.1 and [::1] are answered otherwise.",
)
@click.option("--max-queue", type=int, default=64, show_default=True, help="Requests waiting before 429.")
@click.option(
    "--max-batch",
    type=int,
    default=None,
    help="Requests decoded together, one pass for all; more wait in the queue. [default: what the budget holds, at most"
    f" {DEFAULT_MAX_BATCH}]",
)
@click.option("--max-connections", type=int, default=64, show_default=True, help="Open connections at most.")
@click.option("--header-timeout", type=float, default=10.0, show_default=True, help="Seconds to send the headers.")
@click.option("--body-timeout", type=float, default=60.0, show_default=True, help="Seconds to send the body.")
@click.option(
    "--min-body-rate",
    type=float,
    default=500.0,
    show_default=True,
    help="Bytes/s: a body sent slower may be replaced by a new connection at --max-connections.",
)
@click.option("--budget", type=float, default=None, help="GB the whole process may hold. [default: 80% of available]")
@click.option("--ctx", type=int, default=4096, show_default=True, help="Longest sequence (prompt + answer) served.")
@click.option(
    "--keep-states",
    type=int,
    default=4,
    show_default=True,
    help="Session states kept in RAM for prefix reuse, each sized for --ctx and counted in the plan.",
)
@click.option("--kv-cache", type=click.Path(path_type=Path), help="Also keep session states in this directory.")
@click.option("--kv-cache-gb", type=float, default=10.0, show_default=True, help="Size cap of --kv-cache (GB).")
@click.option("--max-body-mb", type=float, default=8.0, show_default=True, help="Largest request body accepted.")
@click.option("--keep-alive", type=float, default=10.0, show_default=True, help="Seconds between SSE keep-alives.")
@click.option("--gpu", "use_gpu", is_flag=True, help="Dense trunk on a CUDA GPU through CuPy.")
@click.option("--vram", type=float, default=None, help="GB of VRAM --gpu may use.")
@click.option("--threads", type=int, default=None, help="CPU kernel threads.")
@numerics_option(RUN_DEFAULT)
@click.option("--verify", is_flag=True, help="Re-read every expert and streamed layer with plain pread and compare.")
@click.option("--io", type=click.Choice(["direct", "buffered"]), default="direct", show_default=True)
@click.option("--io-threads", type=int, default=4, show_default=True, help="Expert reader threads.")
@click.option("--trunk", type=click.Path(path_type=Path), help="Packed trunk directory.")
@click.option("--tok", type=click.Path(path_type=Path), help="Packed tokenizer.")
@click.option(
    "--prefill-segment",
    type=int,
    default=None,
    help="Prompt tokens that go through each layer together. [default: the plan's]",
)
@click.option(
    "--allow-special",
    is_flag=True,
    help="Let the sampler pick special tokens (placeholders, unused ids), as `dsv4 run` does.",
)
@click.option(
    "--allow-image-urls",
    is_flag=True,
    help="V4.1: fetch http(s) image URLs in requests (size and time limited); without it only data: URIs.",
)
@click.option(
    "--speculate",
    default="auto",
    show_default=True,
    help="Speculative decoding with the checkpoint's DSpark drafter: auto, off or N drafts; the server-wide"
    " default, which a request's `speculate` field overrides. A request drafts while it is the only one in"
    " flight; requests decoded together do not draft.",
)
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def serve(
    checkpoint: Path,
    host: str,
    port: int,
    api_key: str | None,
    cors_origins: tuple[str, ...],
    allowed_hosts: tuple[str, ...],
    max_queue: int,
    max_batch: int | None,
    max_connections: int,
    header_timeout: float,
    body_timeout: float,
    min_body_rate: float,
    budget: float | None,
    ctx: int,
    keep_states: int,
    kv_cache: Path | None,
    kv_cache_gb: float,
    max_body_mb: float,
    keep_alive: float,
    use_gpu: bool,
    vram: float | None,
    threads: int | None,
    numerics: str,
    verify: bool,
    io: str,
    io_threads: int,
    trunk: Path | None,
    tok: Path | None,
    prefill_segment: int | None,
    allow_special: bool,
    allow_image_urls: bool,
    speculate: str,
    debug: bool,
) -> None:
    """Serve CHECKPOINT over HTTP: OpenAI's /v1/chat/completions, /v1/completions, /v1/models,
    Anthropic's /v1/messages, and /health."""
    import uvicorn

    from ..server.app import create_app
    from ..server.images import policy_for
    from ..server.metrics import counting
    from ..server.security import Guard, Policy, host_name, normalize_origins
    from ..server.toolkit import AccessLog, ServerState
    from ..server.transport import Limits, guarded_protocol

    checks = (
        ("--ctx", ctx),
        ("--threads", threads),
        ("--io-threads", io_threads),
        ("--prefill-segment", prefill_segment),
    )
    for name, value in checks:
        if value is not None and value < 1:
            raise UsageError(f"{name} {value}: give at least 1")
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key is empty: give a key (e.g. from `openssl rand -hex 24`), or leave the option out")
    if api_key is not None and (api_key != api_key.strip() or not api_key.isprintable() or not api_key.isascii()):
        raise UsageError("--api-key: use printable ASCII without leading or trailing spaces (it travels in a header)")
    try:
        origins = normalize_origins(cors_origins)
    except ValueError as e:
        raise UsageError(f"--cors-origin {e}") from None
    hosts = _allowed_hosts(allowed_hosts, host_name)
    if max_queue < 0:
        raise UsageError(f"--max-queue {max_queue}: give 0 (never wait) or more")
    if max_batch is not None and max_batch < 1:
        raise UsageError(f"--max-batch {max_batch}: give 1 (one request at a time) or more")
    if max_connections < 1:
        raise UsageError(f"--max-connections {max_connections}: give at least 1")
    if keep_states < 0:
        raise UsageError(f"--keep-states {keep_states}: give 0 (no reuse) or more")
    positive = (
        ("--kv-cache-gb", kv_cache_gb), ("--max-body-mb", max_body_mb), ("--keep-alive", keep_alive),
        ("--header-timeout", header_timeout), ("--body-timeout", body_timeout), ("--min-body-rate", min_body_rate),
    )  # fmt: skip
    for name, value in positive:
        if not 0 < value < float("inf"):
            raise UsageError(f"{name} {value}: give a positive number")
    if not 0 < port < 65536:
        raise UsageError(f"--port {port}: give a port in 1..65535")
    if vram is not None and not use_gpu:
        raise UsageError("--vram applies to --gpu; add --gpu or drop --vram")
    if kv_cache is not None and kv_cache.exists() and not kv_cache.is_dir():
        raise UsageError(f"--kv-cache {kv_cache}: is a file; give a directory (created if missing)")
    checkpoint = checkpoint_dir(checkpoint)
    cfg = ModelConfig.from_json(checkpoint / "config.json")
    spec = speculate_setting(speculate, cfg)
    check_trunk(trunk)
    budget_b = budget_bytes(budget)
    batch = max_batch or max_batch_for(planner.state_bytes_for(cfg, ctx), budget_b)
    if batch > 1 and spec not in ("off", "auto"):
        _say(
            f"dsv4: note: --speculate {spec}: a request drafts while it is the only one in flight; nothing is drafted"
            " while requests are decoded together (--max-batch 1: always one at a time)"
        )
    tokenizer = load_tokenizer(checkpoint, tok, cfg)
    if not is_loopback(host) and not api_key:
        _say(f"dsv4: warning: listening on {host} without --api-key: anyone who can reach it can use the model")

    held: dict[str, object] = {}
    if kv_cache is not None:
        from ..server.cache import FolderLock

        # before loading the model: a folder another running server holds is refused (CacheBusy)
        with contextlib.suppress(OSError):  # one it cannot write: the disk cache says so at start
            held["kv_lock"] = FolderLock(kv_cache)
    sock = bind(host, port)
    srv = ServerState(
        checkpoint.resolve().name, tokenizer, ctx, _say, chat.encoder_for(cfg.layout, cfg.family),
        keep_alive, int(max_body_mb * 1e6), max_queue,
    )  # fmt: skip
    srv.images = policy_for(cfg, allow_image_urls)
    policy = Policy(api_key, is_loopback(host), hosts, origins)
    limits = Limits(header_timeout, body_timeout, max_connections, min_body_rate)
    app = create_app(srv)
    config = uvicorn.Config(
        AccessLog(counting(Guard(app, policy), srv.metrics), _say), log_level="warning", access_log=False, lifespan="off",
        timeout_graceful_shutdown=3, http=guarded_protocol(limits, _say),
    )  # fmt: skip
    server = uvicorn.Server(config)
    failure: list[BaseException] = []
    _say(f'dsv4: loading {checkpoint} (GET http://{host}:{port}/health says "loading" until ready)')

    def load() -> None:
        try:
            gctx = gpu.setup(use_gpu, vram, threads)
            held["gpu"] = gctx
            for line in gctx.take_messages():
                _say(line)
            # a state file being written or read is held twice (bytes and arrays) for a moment
            disk_io = 2 * planner.state_bytes_for(cfg, ctx) if kv_cache is not None else 0
            opts = RunOptions(
                budget=budget_b, io=io, verify=verify, threads=gctx.threads, io_threads=io_threads,
                trunk=trunk, ctx=ctx, kept_states=keep_states, prefill_segment=prefill_segment, live_sequences=batch,
                gpu=gctx if gctx.enabled else None, numerics=numerics,
                overhead=planner.DEFAULT_OVERHEAD + SERVER_OVERHEAD + disk_io,
                speculate=spec,  # a batching server drafts while one request is in flight: the drafter is planned
                images=srv.images.vision is not None,  # the tower and an image's activations, planned
            )  # fmt: skip
            try:
                rt = Runtime.open(checkpoint, opts, warn=lambda m: _say(f"dsv4: {m}"))
            except BudgetError as e:
                if not opts.images:
                    raise
                # text still fits where the tower does not: serve text, and say how to take images
                rt = Runtime.open(checkpoint, replace(opts, images=False), warn=lambda m: _say(f"dsv4: {m}"))
                why = f"--budget {budget} leaves no room for the vision tower ({e}); restart with a larger --budget"
                srv.images = replace(srv.images, vision=None, refusal=f"this server takes no images: {why}")
                _say(f"dsv4: note: images are refused: {why}")
            held["rt"] = rt
            for line in [*gctx.take_messages(), *rt.plan.lines()]:
                _say(line)
            _say(
                f"  serving: up to {batch} requests decoded together (--max-batch), each with its state for --ctx {ctx}"
            )
            srv.worker = _worker(
                rt,
                tokenizer,
                banned_ids(tokenizer, allow_special),
                keep_states,
                ctx,
                kv_cache,
                kv_cache_gb,
                held.get("kv_lock"),
                batch,
            )
            _say(f"listening on http://{host}:{port}")
        except BaseException as e:  # noqa: BLE001  re-raised by the main thread once the server has stopped
            failure.append(e)
            server.should_exit = True

    loader = threading.Thread(target=load, name="dsv4-load", daemon=True)
    loader.start()
    # uvicorn stops on SIGINT/SIGTERM, then raises the signal again under the handler it
    # found: a no-op here, so that the caches and the runtime close and the exit code is 0
    quiet = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in quiet.items():
            signal.signal(sig, handler)
        loader.join()
        if srv.worker is not None:
            srv.worker.close()
        for key in ("rt", "gpu", "kv_lock"):
            if key in held:
                held[key].close()  # type: ignore[attr-defined]
        sock.close()
    if failure:
        raise failure[0]
    _say("dsv4: server stopped")


# what a Host header's name part may be: "*", a DNS name or IPv4 address, a bracketed IPv6 address
_HOST = re.compile(r"\*|\[[0-9a-f:.]+\]|[a-z0-9_]([a-z0-9_.-]{0,251}[a-z0-9_])?")


def _allowed_hosts(values: tuple[str, ...], host_name) -> tuple[str, ...]:
    """The names of --allowed-host (comma-separated, repeatable); one that names no host (empty,
    a bare port, spaces, other characters) is refused, never dropped: an empty list would mean
    "the loopback names only" where a name was meant."""
    out = []
    for value in values:
        for piece in value.split(","):
            name = host_name(piece)
            if not _HOST.fullmatch(name):
                raise UsageError(
                    f"--allowed-host {value[:80]!r}: {piece.strip()[:80]!r} is not a host name; "
                    "give names such as example.com or 192.168.1.5 (comma-separated), or * for any"
                )
            out.append(name)
    return tuple(out)


def _worker(
    rt: Runtime,
    tokenizer,
    banned: list[int],
    keep_states: int,
    ctx: int,
    kv_cache: Path | None,
    kv_cache_gb: float,
    kv_lock=None,
    max_batch: int = 1,
):
    from ..server.cache import CacheUnwritable, DiskCache, StateCache, checkpoint_identity, keyed_decode
    from ..server.worker import Worker

    ram = StateCache(keep_states * planner.state_bytes_for(rt.cfg, ctx))
    disk = None
    if kv_cache is not None:
        fresh = rt.session()
        try:
            disk = DiskCache(
                kv_cache, int(kv_cache_gb * planner.GB), checkpoint_identity(rt.cat), fresh.state, _say, kv_lock,
                fresh.stack.agrees,
            )  # fmt: skip
        except CacheUnwritable as e:
            _say(f"dsv4: warning: {e}; serving without the disk cache (states are kept in RAM only)")
        except OSError as e:
            raise UsageError(f"--kv-cache {kv_cache}: cannot use it ({e.strerror})") from None
    return Worker(
        rt, tokenizer.n_tokens, ram, disk, _say, banned, decode=keyed_decode(tokenizer.decode),
        turn_id=tokenizer.special.user, max_batch=max_batch,
    )  # fmt: skip
