"""How `nanosched serve` starts, drains and stops: the uvicorn server around the app.

Start: the port is bound before the model loads, so a busy port, a privileged one or a host
that does not resolve is one `error:` line (exit 2) at once, not after minutes of loading. The
socket listens only once the app has started.

Stop: SIGTERM, SIGINT and SIGHUP drain alike: uvicorn stops accepting, new requests on open
connections get 503, open requests have `drain_timeout_s` to finish; then each still open ends
with a 503 (a JSON body, or an error event and `[DONE]` on a stream) and the worker stops.
uvicorn's own cut-off, which would end connections without a word, is set past ours. A second
Ctrl-C stops at once, but first ends every open request the same way (503 with a JSON body or
an error event) and gives the handlers up to `FORCED_FLUSH_S` to write it, so no stream is cut
without an event and no client gets uvicorn's plain-text 500; then the worker stops (its
requests all ended, that takes one engine turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from nanosched.errors import ConfigError
from nanosched.runtime.server.app import create_app
from nanosched.runtime.server.connections import (
    ACCEPT_BURST,
    KERNEL_BACKLOG,
    ConnectionLimits,
    accept_errors,
    bounded_cap,
    guarded,
    keep_alive_s,
)
from nanosched.runtime.server.startup import ServeConfig, check_flags, prepare
from nanosched.runtime.server.worker import EngineWorker

log = logging.getLogger("nanosched.serve")
LOOPBACK = ("localhost",)
DRAIN_EXPIRED = "the server is shutting down and the drain time (--drain-timeout) ran out; " \
                "retry on another replica or after the restart"
FORCED = "the server was stopped at once (a second Ctrl-C) before this request finished; " \
         "retry on another replica or after the restart"
RANK_DIED = "the server is stopping: retry on another replica or after the restart"
RANK_GRACE_S = 1.0  # after a collective failed: time for a dead rank's exit to be seen
UVICORN_SLACK_S = 5.0  # uvicorn's own cut-off, after ours has answered every open request
FORCED_FLUSH_S = 2.0  # after a second Ctrl-C: time for the handlers to write their 503s
DRAIN_SIGNALS = (signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()  # besides uvicorn's


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve beyond this machine
        return False


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening), as uvicorn binds one; a port in use,
    a privileged port or a host that is not this machine's is a ConfigError naming the flag."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: cannot be resolved ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port {port}: address {host}:{port} is already in use; stop "
                              f"what listens there or pick another --port") from None
        if exc.errno == errno.EACCES:
            raise ConfigError(f"--port {port}: binding {host}:{port} is not permitted (ports "
                              f"below 1024 need privileges); pick another --port") from None
        raise ConfigError(f"--host {host} --port {port}: cannot bind ({exc.strerror or exc})"
                          ) from None
    sock.set_inheritable(True)
    return sock


def listen_url(sock: socket.socket) -> str:
    """The URL a client reaches the listening `sock` at (an unspecified address as loopback)."""
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _server_class(cfg: ServeConfig, worker: EngineWorker, limits: ConnectionLimits) -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server that drains on SIGHUP as on SIGTERM and SIGINT, and ends every
        open request with a 503 before a forced exit (module docstring)."""

        async def serve(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            self._loop.set_exception_handler(accept_errors(limits))
            await super().serve(sockets)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            for sock in sockets or ():  # asyncio accepts ACCEPT_BURST per wake-up; the kernel
                sock.listen(KERNEL_BACKLOG)  # queues more (connections.py)
                if not self.should_exit:
                    url = listen_url(sock)
                    log.info("listening on %s (OpenAI API: %s/v1; Ctrl-C drains and stops)",
                             url, url)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                old = {sig: signal.signal(sig, self.handle_exit) for sig in DRAIN_SIGNALS}
                try:
                    yield
                finally:
                    for sig, handler in old.items():
                        signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            forced = self.should_exit and sig == signal.SIGINT
            super().handle_exit(sig, frame)
            if forced:  # runs in a signal handler: hand the work to the loop
                self._loop.call_soon_threadsafe(worker.expire, FORCED,
                                                "a second Ctrl-C stopped the server at once")

        async def shutdown(self, sockets: Any = None) -> None:
            worker.begin_drain()
            timer = asyncio.get_running_loop().call_later(
                cfg.drain_timeout_s, worker.expire, DRAIN_EXPIRED)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()
            if self.force_exit:  # uvicorn skips the app's shutdown then: stop the worker here
                await self._flush()
                await self.lifespan.shutdown()

        def rank_died(self, what: str) -> None:
            """In the rank watchdog's thread, before the process exits: every open request
            ends with a 500 (a JSON body, or an error event and [DONE] on a stream), written
            within FORCED_FLUSH_S."""
            loop = getattr(self, "_loop", None)
            if loop is None or loop.is_closed():
                return
            log.error("%s: ending every open request with an error, then the server exits", what)
            worker.fail(f"engine failed: {what}; {RANK_DIED}")  # as an engine step failing on it
            future = asyncio.run_coroutine_threadsafe(self._flush(), loop)
            with contextlib.suppress(Exception):
                future.result(FORCED_FLUSH_S + 1.0)

        async def _flush(self) -> None:
            """Wait (up to FORCED_FLUSH_S) until the handlers have ended and what they wrote
            has left for the kernel."""
            deadline = time.monotonic() + FORCED_FLUSH_S
            while (self.server_state.tasks or any(
                    c.transport.get_write_buffer_size() for c in self.server_state.connections
                    if not c.transport.is_closing())) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)

    return DrainingServer


def build_server(cfg: ServeConfig) -> Any:
    """Prepare the model and return a `uvicorn.Server` (not started) serving it."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    served = prepare(cfg)
    worker = EngineWorker(served.engine, cfg.max_queue)
    app = create_app(served, worker, cfg.drain_timeout_s, cfg.max_request_bytes, cfg.api_key,
                     cfg.stats_interval_s)
    if cfg.api_key is None and not _is_loopback(cfg.host):
        log.warning("--host %s accepts requests from other machines and no --api-key is set: "
                    "anyone who reaches this port can use the model; set --api-key (or "
                    "NANOSCHED_API_KEY) or bind 127.0.0.1", cfg.host)
    limits = ConnectionLimits(cfg.header_timeout_s, cfg.body_timeout_s,
                              bounded_cap(cfg.max_connections))
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="info",
                            http=guarded(AutoHTTPProtocol, limits), backlog=ACCEPT_BURST,
                            timeout_keep_alive=keep_alive_s(limits),
                            timeout_graceful_shutdown=cfg.drain_timeout_s + UVICORN_SLACK_S)
    server = _server_class(cfg, worker, limits)(config)
    group = getattr(served.closer, "group", None)
    if group is not None:  # a dead rank ends the process: first every open request is answered
        group.on_death = server.rank_died
        worker.explain = lambda: (what := group.dead_rank(RANK_GRACE_S)) and f"{what}; {RANK_DIED}"
    server.nanosched_worker = worker  # for tests and the bench: the engine behind the app
    server.nanosched_name = served.name
    server.nanosched_limits = limits
    return server


def run_server(cfg: ServeConfig) -> None:
    """Bind the port, load the model, serve until SIGINT/SIGTERM/SIGHUP, then drain."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="nanosched: %(message)s")
    check_flags(cfg)
    sock = bind_port(cfg.host, cfg.port)
    try:
        server = build_server(cfg)
        server.run(sockets=[sock])
    finally:
        sock.close()
