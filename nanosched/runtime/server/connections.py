"""Bounds on what a connection may hold: the time to send a request, and how many are open.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("nanosched.serve")
LOG_EVERY_S = 10.0
ACCEPT_BURST = 32  # sockets asyncio accepts per wake-up (uvicorn's `backlog`)
KERNEL_BACKLOG = 2048  # the listener's queue in the kernel (uvicorn's default backlog)
# descriptors kept for the model's files, logs, pipes, the listener and two accept bursts
RESERVED_FDS = 64 + 2 * ACCEPT_BURST
OUT_OF_FDS = "socket.accept() out of system resource"  # asyncio's message for EMFILE & co.
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0  # an 8 MiB body at 140 KB/s
CLIENT_KEEPALIVE_S = 5.0  # httpx's default keepalive_expiry (the openai client's too)
PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"  # an interim answer any HTTP/1.1 client skips
PROBE_EVERY_S = 0.05  # how often a half-closed connection is asked whether its client is gone
TCP_CLOSE = 7  # Linux's tcp_info state once a reset arrived


def default_max_connections(cap: int = 1024, in_use: int = 0) -> int:
    """`cap`, or fewer when the descriptor limit leaves less than that after the `in_use`
    descriptors and RESERVED_FDS."""
    soft = descriptor_limit()
    if soft is None:
        return cap
    return max(1, min(cap, soft - in_use - RESERVED_FDS))


def descriptor_limit() -> int | None:
    """The soft RLIMIT_NOFILE, None where there is none."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return None
    if soft == getattr(resource, "RLIM_INFINITY", -1) or soft <= 0:
        return None
    return soft


def open_descriptors() -> int:
    """How many descriptors this process holds now (0 where /proc does not say)."""
    import os

    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def bounded_cap(asked: int | None) -> int:
    """The connection cap: `--max-connections` (default 1024) held below what the descriptors
    left now allow (module docstring); a cap lowered from the one asked is said once."""
    cap = default_max_connections(asked or 1024, open_descriptors())
    if asked is not None and cap < asked:
        log.warning("--max-connections %d: the descriptor limit (ulimit -n %d) leaves room for "
                    "%d open connections; serving at most %d at once (raise ulimit -n for more)",
                    asked, descriptor_limit(), cap, cap)
    return cap


@dataclass
class ConnectionLimits:
    """The bounds, and counts of what they closed (logged in summary)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = field(default_factory=default_max_connections)
    closed: dict[str, int] = field(default_factory=dict)
    open: int = 0  # connections open now
    _logged: float = 0.0

    def count(self, why: str) -> None:
        self.closed[why] = self.closed.get(why, 0) + 1
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            log.warning("closed connections so far: %s (--max-connections %d, header timeout "
                        "%g s, body timeout %g s)",
                        ", ".join(f"{n} {w}" for w, n in sorted(self.closed.items())),
                        self.max_connections, self.header_timeout_s, self.body_timeout_s)


def accept_errors(limits: ConnectionLimits) -> Any:
    """An asyncio exception handler: accept() out of descriptors is counted and logged once,
    without its traceback (asyncio retries a second later by itself); anything else goes to the
    loop's default handler."""
    said = False

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        nonlocal said
        if not str(context.get("message", "")).startswith(OUT_OF_FDS):
            loop.default_exception_handler(context)
            return
        limits.closed["accept() out of descriptors"] = \
            limits.closed.get("accept() out of descriptors", 0) + 1
        if not said:
            said = True
            exc = context.get("exception")
            log.warning("out of file descriptors (%s; ulimit -n %s, %d connections open): new "
                        "connections wait until some close; lower --max-connections or raise "
                        "ulimit -n (logged once)", exc.strerror if isinstance(exc, OSError)
                        else exc, descriptor_limit(), limits.open)

    return handle


def keep_alive_s(limits: ConnectionLimits) -> int:
    """uvicorn's `timeout_keep_alive`: past the header timeout, which closes an idle keep-alive
    connection first (module docstring)."""
    return math.ceil(limits.header_timeout_s) + 1


def _raw_response(status: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


BUSY = _raw_response("503 Service Unavailable", "too many open connections; retry later",
                     "too_many_connections")
SLOW_HEADERS = _raw_response("408 Request Timeout", "the request headers did not arrive in "
                             "time", "request_timeout")
SLOW_BODY = _raw_response("408 Request Timeout", "the request body did not arrive in time",
                          "request_timeout")


def guarded(base: type[asyncio.Protocol], limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's protocol class `base` with the bounds of `limits` (module docstring)."""

    class Guarded(base):  # type: ignore[misc, valid-type]
        _timer: asyncio.TimerHandle | None = None
        _what = ""  # what the armed timer waits for: "headers" or "body"
        _seen: Any = None  # the request cycle whose headers have been seen
        _half_closed = False  # the client sent FIN after a whole request
        _probe: asyncio.TimerHandle | None = None  # the next look at a half-closed socket

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            limits.open = len(self.connections)
            if len(self.connections) > limits.max_connections:
                limits.count("over the connection limit")
                transport.write(BUSY)
                transport.close()
                return
            self._arm(limits.header_timeout_s, "headers")

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            cycle = self.cycle
            if self._half_closed and (cycle is None or cycle.response_complete):
                self.transport.close()  # answered all it sent; it can send nothing more
            if not self.transport.is_closing():
                self._disarm()  # the next request's headers get a deadline of their own
                self._track()

        def eof_received(self) -> bool | None:
            """The client sent FIN: after a whole request, answer it (a half-close,
            `shutdown(SHUT_WR)`); mid-request or between requests it has left (module notes)."""
            cycle = self.cycle
            if cycle is None or cycle.response_complete or cycle.more_body or \
                    _tcp_state(self.transport) is None:
                return super().eof_received()  # None: asyncio closes the transport
            self._half_closed = True
            if not cycle.response_started and cycle.scope.get("http_version") == "1.1":
                self.transport.write(PROBE)  # a client that closed answers it with a reset
                self._watch()
            return True

        def _watch(self) -> None:
            if self.transport.is_closing():
                return
            if _tcp_state(self.transport) == TCP_CLOSE:
                limits.count("client closed after its request")
                self.transport.abort()  # the app sees http.disconnect: the request is aborted
                return
            self._probe = self.loop.call_later(PROBE_EVERY_S, self._watch)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._probe is not None:
                self._probe.cancel()
            self._disarm()
            super().connection_lost(exc)
            limits.open = len(self.connections)

        def _track(self) -> None:
            """Arm the timer for what the connection waits for now: a request's headers (a
            deadline kept, not moved, while they trickle in), its body, or nothing."""
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                if self._what != "headers":
                    self._arm(limits.header_timeout_s, "headers")
            elif cycle is not self._seen:  # a new request's headers are in
                self._seen = cycle
                if cycle.more_body:
                    self._arm(limits.body_timeout_s, "body")
                else:
                    self._disarm()
            elif not cycle.more_body:
                self._disarm()  # the whole body is in

        def _arm(self, seconds: float, what: str) -> None:
            self._disarm()
            self._timer, self._what = self.loop.call_later(seconds, self._expire, what), what

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._what = None, ""

        def _expire(self, what: str) -> None:
            self._timer, self._what = None, ""
            cycle = self.cycle
            idle = cycle is None or cycle.response_complete
            if self.transport.is_closing() or (what == "headers") != idle or (
                    what == "body" and not cycle.more_body):
                return  # the request moved on since the timer was armed
            limits.count(f"slow {what}")
            if idle and self._seen is not None:
                pass  # an idle keep-alive connection: closed without a word, as uvicorn's own
            elif idle or not cycle.response_started:
                self.transport.write(SLOW_HEADERS if what == "headers" else SLOW_BODY)
            self.transport.close()

    Guarded.__name__ = f"Guarded{base.__name__}"
    return Guarded


def _tcp_state(transport: Any) -> int | None:
    """The kernel's TCP state of `transport`'s socket, None where it does not say."""
    sock = transport.get_extra_info("socket")
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except (AttributeError, OSError, TypeError, IndexError):
        return None
