"""The engine thread: the one thread that owns the model, the KV cache and the GPU.

Its loop: take the inbox (new requests, aborts) under a lock, `engine.step()`, and publish each
request's new tokens and its end to that request's asyncio queue with
`loop.call_soon_threadsafe`. With no work it sleeps on a condition variable (no spinning).

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nanosched.kernels.common import bind_device
from nanosched.runtime.engine import Engine
from nanosched.runtime.requests import Request, SamplingParams

log = logging.getLogger("nanosched.serve")
THROUGHPUT_WINDOW_S = 10.0
SAMPLING_FAILED = ("sampling failed: the model's logits for this request are not finite (NaN or "
                   "inf); the request was ended, other requests are unaffected")


class QueueFull(Exception):
    """More requests wait for admission than the queue bound allows."""


class Unavailable(Exception):
    """The worker is stopping or has failed."""


@dataclass(frozen=True)
class Update:
    """New tokens of one request; `finish_reason` or `error` when it ended."""

    tokens: list[int]
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500  # the HTTP status of `error`


@dataclass
class _Client:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Counters:
    received: int = 0
    finished: int = 0
    aborted: int = 0
    rejected: int = 0
    generated_tokens: int = 0
    window: deque = field(default_factory=deque)  # (time, tokens processed) per step


class EngineWorker:
    """Runs `engine` in a background thread (see the module docstring)."""

    def __init__(self, engine: Engine, max_queue: int) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.counters = _Counters()
        self.failed: str | None = None
        self.explain: Callable[[], str | None] | None = None  # the cause of an engine failure
        self._cond = threading.Condition()
        self._inbox: list[Request] = []
        self._aborts: list[int] = []
        self._clients: dict[int, _Client] = {}
        self._num_running = 0
        self._next_id = 0
        self._stopping = False
        self._tokens: dict[int, list[int]] = {}
        self._last_tokens = 0
        engine.on_token = self._collect
        self._thread = threading.Thread(target=self._main, name="nanosched-engine", daemon=True)

    # ---- HTTP side -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               loop: asyncio.AbstractEventLoop) -> tuple[int, asyncio.Queue]:
        with self._cond:
            if self._stopping or self.failed:
                raise Unavailable(self.failed or "the server is shutting down")
            if len(self._clients) - self._num_running >= self.max_queue:
                self.counters.rejected += 1
                raise QueueFull(f"{self.max_queue} requests already wait (--max-queue)")
            rid, self._next_id = self._next_id, self._next_id + 1
            queue: asyncio.Queue = asyncio.Queue()
            self._clients[rid] = _Client(loop, queue)
            arrival = self.engine.clock() - self.engine.t0
            self._inbox.append(Request(rid, list(prompt_ids), params, arrival_s=arrival))
            self.counters.received += 1
            self._cond.notify()
        return rid, queue

    def abort(self, request_id: int, stopped: bool = False) -> None:
        """End a request early; `stopped`: it reached a stop string (counted as finished,
        not as aborted)."""
        with self._cond:
            if self._clients.pop(request_id, None) is not None:
                self._aborts.append(request_id)
                if stopped:
                    self.counters.finished += 1
                else:
                    self.counters.aborted += 1
                self._cond.notify()

    def begin_drain(self) -> None:
        """Refuse new requests (503) and let the open ones finish."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def expire(self, message: str, why: str = "drain time ran out") -> int:
        """End every open request now: each client gets `message` with status 503 and the
        engine aborts them (pages freed); `why` is what the log says ended them. Returns how
        many were open."""
        with self._cond:
            self._stopping = True
            clients, self._clients = self._clients, {}
            self._aborts += list(clients)
            self.counters.aborted += len(clients)
            self._cond.notify()
        for client in clients.values():
            _send(client, Update([], error=message, status=503))
        if clients:
            log.warning("%s: %d open requests ended with 503 (a JSON body, or an error event "
                        "on a stream)", why, len(clients))
        return len(clients)

    def stop(self, timeout_s: float) -> bool:
        """Finish every submitted request, then end the thread; False if that took longer
        than `timeout_s` (the daemon thread is then left to die with the process)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("engine drain timed out after %.1f s with %d requests open",
                        timeout_s, len(self._clients))
        return not self._thread.is_alive()

    def snapshot(self) -> dict[str, Any]:
        """Figures for /metrics (read without stopping the engine)."""
        eng, c = self.engine, self.counters
        alloc = eng.ws.kv.allocator
        with self._cond:
            open_, running, window = len(self._clients), self._num_running, list(c.window)
        now = time.perf_counter()
        recent = sum(n for t, n in window if now - t <= THROUGHPUT_WINDOW_S)
        return {
            "requests_received": c.received, "requests_finished": c.finished,
            "requests_aborted": c.aborted, "requests_rejected": c.rejected,
            "requests_running": running, "queue_length": max(0, open_ - running),
            "iterations": eng.stats.iterations, "fallbacks": eng.stats.fallbacks,
            "tokens_processed": eng.stats.tokens, "tokens_generated": c.generated_tokens,
            "prompt_tokens_processed": eng.stats.prefill_tokens,
            "batch_size": eng.stats.batch_sizes[-1] if eng.stats.batch_sizes else 0,
            "kv_pages_total": alloc.num_pages, "kv_pages_in_use": alloc.num_in_use,
            "throughput_tokens_per_s": recent / THROUGHPUT_WINDOW_S,
            "prefix_cache_queries": eng.scheduler.stats.prefix_queries,
            "prefix_cache_hits": eng.scheduler.stats.prefix_hits,
        }

    # ---- engine thread ---------------------------------------------------------------------
    def _collect(self, req: Request, token: int) -> None:
        self._tokens.setdefault(req.request_id, []).append(token)

    def _main(self) -> None:
        bind_device(self.engine.model.device)  # this thread launches the engine's kernels
        try:
            with torch.inference_mode():
                while self._turn():
                    pass
        except Exception as exc:  # noqa: BLE001 - any engine failure ends every request
            log.exception("engine failed")
            why = self.explain() if self.explain is not None else None
            self.fail(f"engine failed: {why or f'{type(exc).__name__}: {exc}'}")

    def _turn(self) -> bool:
        """One loop turn; False when the worker should end."""
        with self._cond:
            while not (self._inbox or self._aborts or self.engine.has_work or self._stopping):
                self._cond.wait()
            if self._stopping and not (self._inbox or self.engine.has_work):
                return False
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for req in new:
            self.engine.add_request(req)  # the HTTP side checked that it fits
        for rid in aborts:
            self.engine.abort(rid)
        if aborts:  # no step may follow (nothing else to run): keep /metrics current
            with self._cond:
                self._num_running = len(self.engine.scheduler.running)
        if self.engine.has_work:
            ended = self.engine.step()
            self._publish(ended)
        return True

    def _publish(self, ended: list[Request]) -> None:
        eng = self.engine
        tokens, self._tokens = self._tokens, {}
        reasons = {r.request_id: r.finish_reason for r in ended}
        eng.finished.clear()  # a server keeps no history
        del eng.stats.batch_sizes[:-1]
        with self._cond:
            self._num_running = len(eng.scheduler.running)
            self.counters.generated_tokens += sum(map(len, tokens.values()))
            now = time.perf_counter()
            self.counters.window.append((now, eng.stats.tokens - self._last_tokens))
            self._last_tokens = eng.stats.tokens
            while now - self.counters.window[0][0] > THROUGHPUT_WINDOW_S:
                self.counters.window.popleft()
            for rid in tokens.keys() | reasons.keys():
                client = self._clients.get(rid)
                if client is None:  # aborted (and counted so) before the engine ended it
                    continue
                if rid in reasons:
                    self._clients.pop(rid)
                    self.counters.finished += 1
                if reasons.get(rid) == "error":
                    _send(client, Update(tokens.get(rid, []), error=SAMPLING_FAILED))
                else:
                    _send(client, Update(tokens.get(rid, []), reasons.get(rid)))

    def fail(self, message: str) -> None:
        """Mark the worker failed (/health 503, new requests 503) and end every open request
        with `message` (a 500); any thread."""
        with self._cond:
            self.failed = message
            clients, self._clients = self._clients, {}
        for client in clients.values():
            _send(client, Update([], error=message))


def _send(client: _Client, update: Update) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
        client.loop.call_soon_threadsafe(client.queue.put_nowait, update)
