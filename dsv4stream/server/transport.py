"""Slow and many clients: uvicorn's HTTP/1.1 protocol (h11) with read deadlines and a cap.

Owns: `GuardedH11`, the connection class `dsv4 serve` gives uvicorn. uvicorn times out only
idle keep-alive connections: a client that sends its headers (or its body) a byte at a
time holds a connection for ever, and enough of them hold them all. Here:

- a request's headers must be complete within `header_timeout` seconds of the connection
  opening (later requests on a kept-alive connection: uvicorn's keep-alive timeout);
- its body within `body_timeout` seconds of its headers;
- at most `max_connections` connections are open at once. A new one past the cap takes the
  place of the slow reader that has waited longest for its request: one still sending its
  headers (or idle between keep-alive requests), or one sending its body for over
  `BODY_GRACE` seconds at under `min_body_rate` bytes a second on average (a body the server
  itself stopped reading, by flow control, is not slow). Only when every open connection has
  a request under way (read, or its body arriving at a fair rate) is the new one closed at
  once. So slow clients cannot lock others out, whichever part they trickle: each waits out
  its own deadline, but a newcomer does not wait behind them (issue 40).

A deadline missed closes the connection (a route waiting for the body sees the client
gone). Time spent generating an answer is not limited: a request counts as read once its
body has arrived.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

# Seconds a body may take before its rate is judged: a request whose body is on its way (a
# network round trip, a client still serialising) is not slow yet.
BODY_GRACE = 2.0


@dataclass(frozen=True)
class Limits:
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_connections: int = 64
    min_body_rate: float = 500.0  # bytes/s: a body slower than this (after BODY_GRACE) may be replaced


def guarded_protocol(limits: Limits, log=None) -> type[H11Protocol]:
    """An H11Protocol subclass bound to `limits` (uvicorn builds one instance per connection)."""

    class GuardedH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _seen_cycle: object = None
        _waiting_since = 0.0  # monotonic time since which it has waited for a request (headers first)
        _received = 0  # bytes received on this connection
        _body_mark: tuple[float, int] | None = None  # (time, _received) when the body began; None: no body under way

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._waiting_since = time.monotonic()
            if len(self.connections) > limits.max_connections and not self._make_room():
                if log is not None:
                    log(f"dsv4: refused a connection: {limits.max_connections} already open (--max-connections)")
                transport.close()
                return
            self._arm(limits.header_timeout)

        def _awaits_headers(self) -> bool:
            """No request under way: its headers not (all) in yet, or idle after a response."""
            cycle = self.cycle
            return (cycle is None or cycle.response_complete) and not self.transport.is_closing()

        def _slow_body(self, now: float) -> bool:
            """Its request's body is still arriving, for over BODY_GRACE seconds at under
            min_body_rate on average, and not because the server paused reading it."""
            cycle, mark = self.cycle, self._body_mark
            if cycle is None or mark is None or not cycle.more_body or cycle.response_started:
                return False
            if self.transport.is_closing() or self.flow.read_paused:
                return False
            elapsed = now - mark[0]
            return elapsed > BODY_GRACE and self._received - mark[1] < limits.min_body_rate * elapsed

        def _make_room(self) -> bool:
            """Close the slow reader (headers, or a slow body) that has waited longest for its
            request; False if no open connection is one."""
            now = time.monotonic()
            slow = [
                c
                for c in self.connections
                if c is not self and isinstance(c, GuardedH11) and (c._awaits_headers() or c._slow_body(now))
            ]
            if not slow:
                return False
            victim = min(slow, key=lambda c: c._waiting_since)
            if log is not None:
                what = "request headers" if victim._awaits_headers() else "a slow request body"
                log(f"dsv4: closed a connection waiting {now - victim._waiting_since:.1f} s for {what} to admit"
                    " a new one (--max-connections)")  # fmt: skip
            victim._disarm()
            victim.transport.close()
            return True

        def data_received(self, data: bytes) -> None:
            self._received += len(data)
            super().data_received(data)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            cycle = self.cycle
            if cycle is not None and cycle is not self._seen_cycle:  # headers of a new request are in
                self._seen_cycle = cycle
                self._body_mark = (time.monotonic(), self._received)
                self._arm(limits.body_timeout)
            if cycle is not None and not cycle.more_body:
                self._body_mark = None
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._waiting_since = time.monotonic()  # idle until the next request's headers

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            cycle = self.cycle
            unread = cycle is None or (cycle.more_body and not cycle.response_started)
            if unread and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11
