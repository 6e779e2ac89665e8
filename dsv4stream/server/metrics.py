"""`GET /metrics`: the server's figures in Prometheus' text format (`prometheus-client`).

Owns: the request counter (by route and status, counted as each response starts) and a
collector that reads the live figures at scrape time: tokens (prompt, cached, generated),
prefill and decode seconds, prefix-cache hits by source, the queue (waiting, running), the
batch (--max-batch, decode passes and the request tokens they carried, each running request's
decode rate by slot), expert-store requests / hits / bytes read and trunk bytes read from disk, the
process's resident memory (now and peak), and speculative decoding's counts (`--speculate`, the
ended generations' as /v1/stats sums them: drafted, accepted and verified tokens, verification
passes, plain steps, re-feeds, seconds with drafts and the estimate without, `auto`'s watches
with their drafted and confirmed tokens, and the cycles by draft length, which for `auto` are
its decisions). One registry per app, so two servers in one
process (the tests) do not share counters. Names start with `dsv4_`; counters end in
`_total` as Prometheus expects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psutil
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.spec_stats import SpecCounts
from ..run.memory import peak_rss_bytes

ROUTES = (
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/models", "/v1/stats", "/health", "/metrics",
)  # fmt: skip

_COUNTERS = (
    ("requests_served", "requests_served", "Requests answered by the engine"),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of answered requests"),
    ("cached_tokens", "cached_prompt_tokens", "Prompt tokens read from the prefix cache instead of prefilled"),
    ("completion_tokens", "completion_tokens", "Tokens generated"),
    ("prefill_seconds", "prefill_seconds", "Seconds spent prefilling (to the first token)"),
    ("decode_seconds", "decode_seconds", "Seconds spent generating after the first token"),
    ("expert_requests", "expert_requests", "Routed experts asked of the expert store"),
    ("expert_hits", "expert_hits", "Routed experts found in the expert cache"),
    ("expert_bytes_read", "expert_disk_read_bytes", "Bytes of routed experts read from disk"),
    ("trunk_bytes_read", "trunk_disk_read_bytes", "Bytes of streamed trunk layers read from disk"),
    ("batch_passes", "decode_passes", "Decode passes run (each carries the next token of every request in the batch)"),
    ("batch_rows", "decode_pass_rows", "Request tokens those passes carried (over decode_passes: the mean batch)"),
)

_SPECULATION = (
    ("drafted", "drafted_tokens", "Tokens the drafter proposed"),
    ("accepted", "accepted_tokens", "Drafted tokens the main model's picks confirmed"),
    ("verified_tokens", "verified_tokens", "Tokens fed in verification passes (each pass's own token and its drafts)"),
    ("verify_passes", "verify_passes", "Verification passes (cycles with at least one draft)"),
    ("steps", "plain_steps", "Cycles without a draft (one-token steps)"),
    ("refeeds", "refeeds", "Rejections whose kept tokens were fed again"),
    ("refeed_tokens", "refeed_tokens", "Kept tokens fed again after a rejection"),
    ("tokens", "tokens", "Tokens picked by generations that could draft (after each prompt's first)"),
    ("seconds", "seconds", "Decode seconds of generations that could draft (drafter, passes, picks)"),
    ("seconds_without", "seconds_without_estimated", "Their estimated decode seconds without drafts"),
    ("draft_seconds", "draft_seconds", "Seconds spent in the drafter"),
    ("expert_bytes", "expert_disk_read_bytes", "Expert bytes read from disk while they decoded"),
    ("watches", "watches", "Drafter runs under auto whose drafts were only compared with the next picks, never fed"),
    ("watch_drafted", "watch_drafted_tokens", "Tokens those watches drafted"),
    ("watch_accepted", "watch_accepted_tokens", "Watched drafts the picks confirmed (before the first wrong one)"),
)


def _speculation(spec: SpecCounts | None):
    """Speculation's counter families (zeros before any generation that could draft has ended)."""
    spec = spec or SpecCounts()
    for attr, name, doc in _SPECULATION:
        yield CounterMetricFamily(f"dsv4_speculation_{name}", doc, value=getattr(spec, attr))
    cycles = CounterMetricFamily(
        "dsv4_speculation_cycles",
        "Decode cycles by the draft length chosen (0: a plain step; under --speculate auto, its decisions)",
        labels=["draft_length"],
    )
    for k, n in sorted(spec.lengths.items()):
        cycles.add_metric([str(k)], n)
    yield cycles


class _Live:
    def __init__(self, srv: Any) -> None:
        self.srv = srv

    def collect(self):
        w = self.srv.worker
        if w is not None:
            c = w.stats.counters()
            for key, name, doc in _COUNTERS:
                yield CounterMetricFamily(f"dsv4_{name}", doc, value=c[key])
            hits = CounterMetricFamily("dsv4_prefix_cache_hits", "Requests that reused a kept state", labels=["source"])
            hits.add_metric(["ram"], c["cache_hits_ram"])
            hits.add_metric(["disk"], c["cache_hits_disk"])
            yield hits
            yield from _speculation(w.stats.speculation())
        queue = GaugeMetricFamily("dsv4_queue_requests", "Requests waiting or running", labels=["state"])
        queue.add_metric(["waiting"], w.waiting if w is not None else 0)
        queue.add_metric(["running"], w.running if w is not None else 0)
        yield queue
        if w is not None:
            yield GaugeMetricFamily(
                "dsv4_max_batch", "Requests decoded together at most (--max-batch)", value=w.max_batch
            )
            rates = GaugeMetricFamily(
                "dsv4_request_decode_tokens_per_second", "Decode rate so far of each running request", labels=["slot"]
            )
            for k, r in enumerate(w.stats.running()):
                rates.add_metric([str(k)], r["decode_tokens_per_s"])
            yield rates
        yield GaugeMetricFamily("dsv4_model_loaded", "1 once the model is loaded", value=1 if w is not None else 0)
        yield GaugeMetricFamily(
            "dsv4_resident_memory_bytes", "Resident set size now", value=psutil.Process().memory_info().rss
        )
        yield GaugeMetricFamily("dsv4_peak_resident_memory_bytes", "Peak resident set size", value=peak_rss_bytes())


class Metrics:
    def __init__(self, srv: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "dsv4_http_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.registry.register(_Live(srv))

    def count(self, path: str, status: int) -> None:
        route = path if path in ROUTES else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        self.requests.labels(route, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def counting(app, metrics: Metrics) -> Callable:
    """ASGI middleware: count each response by route and status as it starts."""

    async def wrapped(scope, receive, send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_(msg) -> None:
            if msg["type"] == "http.response.start":
                metrics.count(scope["path"], msg["status"])
            await send(msg)

        await app(scope, receive, send_)

    return wrapped
