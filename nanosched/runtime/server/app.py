"""`nanosched serve`: the FastAPI app and the uvicorn server around an `EngineWorker`.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with
`"stream": true`, ending with `data: [DONE]`), GET /v1/models, /health (503 once the engine
failed), /metrics (Prometheus text). Every error body is OpenAI's `{"error": {...}}`. With an
API key the /v1/ routes need `Authorization: Bearer <key>` (401 otherwise); /health and
/metrics stay open for probes. A 429 (queue full) carries `Retry-After`.

A client that goes away mid-request gets its request aborted at once (KV pages and batch slot
freed): a stream when Starlette cancels its generator, a whole response when the task watching
the connection sees `http.disconnect`. SIGTERM or
SIGINT: uvicorn stops accepting, new requests on open connections get 503, open requests have
`drain_timeout_s` to finish; then each still open ends with a 503 (a JSON body, or an error event
and `[DONE]` on a stream) and the worker stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from nanosched.runtime.server.protocol import (
    MAX_NESTING,
    ApiError,
    Job,
    Limits,
    check_nesting,
    parse_chat,
    parse_completion,
)
from nanosched.runtime.server.responses import (
    chunk_event,
    completion_body,
    merge_choices,
    render_metrics,
    sse,
    usage_event,
)
from nanosched.runtime.server.startup import (
    DEFAULT_MAX_REQUEST_BYTES,
    ServeConfig,
    Served,
    prepare,
)
from nanosched.runtime.server.statslog import StatsLogger
from nanosched.runtime.server.text import Detokenizer, StopText
from nanosched.runtime.server.worker import EngineWorker, QueueFull, Unavailable, Update

log = logging.getLogger("nanosched.serve")


class _AsciiJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error may echo text no UTF-8 encoder accepts."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _error(exc: ApiError) -> JSONResponse:
    return _AsciiJSON(exc.body(), status_code=exc.status, headers=exc.headers)


def _internal(request: Request, exc: Exception) -> JSONResponse:
    """Any exception no check foresaw: logged with its traceback, answered as a JSON 500."""
    log.error("%s %s failed", request.method, request.url.path,
              exc_info=(type(exc), exc, exc.__traceback__))
    return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                           code="internal_error", kind="server_error"))


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it exceeds `limit` bytes: by its declared
    Content-Length before anything is read, else while it streams in (chunked uploads), so an
    oversized body is never held in memory whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {limit} bytes", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(found: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body is {found}; this server accepts at most {limit} "
                         f"bytes (--max-request-bytes)", code="request_too_large")


def _decode_json(raw: bytes) -> Any:
    """The body as JSON, refused with 400 when it is not UTF-8 JSON or nests too deep."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})",
                       code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, f"the request body nests more than {MAX_NESTING} levels of "
                            f"arrays and objects", code="invalid_body") from None
    check_nesting(body)
    return body


class Handler:
    """Turns validated jobs into engine requests and their answers."""

    def __init__(self, served: Served, worker: EngineWorker) -> None:
        self.served, self.worker = served, worker
        spec = served.spec
        self.limits = Limits(served.name, spec.vocab_size, served_context(served.engine))

    def submit(self, job: Job) -> tuple[int, asyncio.Queue]:
        try:  # a request longer than the whole KV cache can never run
            self.served.engine.batcher.check_fits(_probe(job))
        except ValueError as exc:
            raise ApiError(400, f"max_tokens: {exc}", param="max_tokens",
                           code="invalid_value") from None
        try:
            return self.worker.submit(job.prompt_ids, job.params, asyncio.get_running_loop())
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy: {exc}; retry later",
                           code="rate_limit_exceeded", kind="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except Unavailable as exc:
            raise ApiError(503, str(exc), code="unavailable", kind="server_error") from None

    async def whole(self, request: Request, job: Job) -> JSONResponse:
        """The whole answer: one choice per prompt and per `n`, each its own engine request,
        run concurrently; if one fails (or the client goes), the others are aborted."""
        name = _name(job)
        jobs = [replace(job, prompt_ids=ids) for ids in (job.prompts or (job.prompt_ids,))
                for _ in range(job.n)]
        tasks = [asyncio.ensure_future(self._collect(request, j)) for j in jobs]
        try:
            answers = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        if any(a is None for a in answers):
            return JSONResponse({}, status_code=499)  # nobody reads it
        bodies = [completion_body(name, self.served.name, job.is_chat, text, ids, reason,
                                  len(j.prompt_ids))
                  for j, (text, ids, reason) in zip(jobs, answers, strict=True)]
        return JSONResponse(merge_choices(bodies, job.n))

    async def _collect(self, request: Request, job: Job) -> tuple[str, list[int], str] | None:
        """(text, token ids, finish reason) of one engine request, or None if the client went.
        A task watches the connection meanwhile, so a client that goes away aborts its request
        at once (KV pages and batch slot freed), not when the answer would have been complete.
        A stop string ends it the same way, at once."""
        rid, queue = self.submit(job)
        ids, reason, ended = [], None, False  # ended: the engine finished the request
        detok, stopper, text = Detokenizer(self.served.codec), StopText(job.stop), ""
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while reason is None:
                got = asyncio.ensure_future(queue.get())
                await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    return None
                update = got.result()
                ended = update.error is not None or update.finish_reason is not None
                _raise_error(update)
                ids += update.tokens
                reason = update.finish_reason
                if job.stop:
                    text += stopper.push(detok.push(update.tokens, final=ended))
                    reason = "stop" if stopper.done else reason
        finally:
            gone.cancel()
            if not ended:
                self.worker.abort(rid, stopped=reason == "stop")
        text = text + stopper.flush() if job.stop else self.served.codec.decode(ids)
        return text, ids, reason

    def stream(self, job: Job) -> StreamingResponse:
        rid, queue = self.submit(job)
        return StreamingResponse(self._events(rid, queue, job), media_type="text/event-stream")

    async def _events(self, rid: int, queue: asyncio.Queue, job: Job) -> AsyncIterator[str]:
        """The stream: (chat: a role chunk), a chunk per update, with stop strings cut out, an
        error event if the request failed, the usage chunk if asked for, then [DONE]."""
        name, model = _name(job), self.served.name
        detok, stopper, ended, n_out = Detokenizer(self.served.codec), StopText(job.stop), \
            False, 0
        try:
            if job.is_chat:
                yield chunk_event(name, model, True, None, [], None, job.include_usage)
            while True:
                update: Update = await queue.get()
                ended = update.error is not None or update.finish_reason is not None
                if update.error:
                    yield sse(_update_error(update).body())
                    break
                n_out += len(update.tokens)
                text = stopper.push(detok.push(update.tokens, final=ended))
                reason = "stop" if stopper.done else update.finish_reason
                if ended and not stopper.done:
                    text += stopper.flush()
                yield chunk_event(name, model, job.is_chat, text, update.tokens, reason,
                                  job.include_usage)
                if reason is not None:
                    break
            if job.include_usage:
                yield usage_event(name, model, job.is_chat, len(job.prompt_ids), n_out)
            yield sse("[DONE]")
        finally:
            if not ended:
                self.worker.abort(rid, stopped=stopper.done)


async def _wait_disconnect(request: Request) -> None:
    """Return when the client has gone. Once the body is read, the server's next ASGI message
    for this request is `http.disconnect`, sent as soon as the connection closes."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _probe(job: Job) -> Any:
    from nanosched.runtime.requests import Request as EngineRequest

    return EngineRequest(-1, job.prompt_ids, job.params)


def _name(job: Job) -> str:
    """A response id unique across requests and server restarts (a random UUID, as OpenAI's
    ids are opaque): clients and logs may key on it."""
    return f"{'chatcmpl' if job.is_chat else 'cmpl'}-{uuid.uuid4().hex}"


def served_context(engine: Any) -> int:
    """The longest request (prompt + output) the engine can ever run: the model's context, or
    less when the KV cache holds fewer tokens (a request needs ceil(tokens / page) + 1 pages,
    `Batcher.check_fits`). /v1/models advertises it as max_model_len, and a chat request
    without max_tokens gets what is left of it after the prompt."""
    b = engine.batcher
    return max(1, min(b.max_context, (b.capacity_pages - 1) * b.page_size))


def _update_error(update: Update) -> ApiError:
    code = "unavailable" if update.status == 503 else "engine_failed"
    return ApiError(update.status, update.error or "", code=code, kind="server_error")


def _raise_error(update: Update) -> None:
    if update.error:
        raise _update_error(update)


def create_app(served: Served, worker: EngineWorker, drain_timeout_s: float = 30.0,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               api_key: str | None = None, stats_interval_s: float = 0.0) -> FastAPI:
    """The app; its lifespan starts the worker (and, with `stats_interval_s` > 0, the periodic
    throughput/queue line) and, at shutdown, drains and stops them."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        stats = StatsLogger(worker.snapshot, stats_interval_s) if stats_interval_s > 0 else None
        if stats is not None:
            stats.start()
        yield
        if stats is not None:
            stats.stop()
        await asyncio.to_thread(worker.stop, drain_timeout_s)
        if served.closer is not None:
            served.closer.close()

    app = FastAPI(title="nanosched", lifespan=lifespan)
    handler = Handler(served, worker)
    app.add_exception_handler(ApiError, lambda _, exc: _error(exc))
    app.add_exception_handler(Exception, _internal)
    app.add_exception_handler(HTTPException, lambda _, exc: _error(
        ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404
                 else None)))

    async def job(request: Request, parse: Callable[..., Job]) -> Job:
        """Read the body (bounded), then decode, validate and tokenize it in a worker thread:
        a huge prompt takes seconds to tokenize, and the event loop must keep serving."""
        _authorize(request, api_key)  # before the body is read
        raw = await _read_body(request, max_request_bytes)
        return await asyncio.to_thread(lambda: parse(_decode_json(raw), served.codec,
                                                     handler.limits))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        j = await job(request, parse_completion)
        return handler.stream(j) if j.stream else await handler.whole(request, j)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        j = await job(request, parse_chat)
        return handler.stream(j) if j.stream else await handler.whole(request, j)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _authorize(request, api_key)
        return {"object": "list", "data": [{
            "id": served.name, "object": "model", "created": 0, "owned_by": "nanosched",
            "max_model_len": handler.limits.context, "strategy": served.strategy}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        if worker.failed:
            return JSONResponse({"status": "failed", "reason": worker.failed}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(worker.snapshot()),
                                 media_type="text/plain; version=0.0.4")

    return app


RETRY_AFTER_S = 1  # 429: a queue slot frees as soon as one request is admitted
LOOPBACK = ("localhost",)


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve beyond this machine
        return False


def _authorize(request: Request, api_key: str | None) -> None:
    """With an API key, /v1/ routes need `Authorization: Bearer <key>` (as vLLM's
    --api-key); compared in constant time."""
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             api_key.encode()):
        raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer "
                            "<key>' with the key given to --api-key", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


DRAIN_EXPIRED = "the server is shutting down and the drain time (--drain-timeout) ran out; " \
                "retry on another replica or after the restart"
UVICORN_SLACK_S = 5.0  # uvicorn's own cut-off, after ours has answered every open request


def build_server(cfg: ServeConfig) -> Any:
    """Prepare the model and return a `uvicorn.Server` (not started) serving it."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server whose shutdown (SIGTERM, SIGINT) refuses new requests, gives the
        open ones `drain_timeout_s` to finish, then ends each with a 503: a JSON error body,
        or an error event and `[DONE]` on a stream. uvicorn's own timeout, which would cut
        connections without a word, is set past ours so it never fires first."""

        async def shutdown(self, sockets: Any = None) -> None:
            worker.begin_drain()
            timer = asyncio.get_running_loop().call_later(
                cfg.drain_timeout_s, worker.expire, DRAIN_EXPIRED)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    served = prepare(cfg)
    worker = EngineWorker(served.engine, cfg.max_queue)
    app = create_app(served, worker, cfg.drain_timeout_s, cfg.max_request_bytes, cfg.api_key,
                     cfg.stats_interval_s)
    if cfg.api_key is None and not _is_loopback(cfg.host):
        log.warning("--host %s accepts requests from other machines and no --api-key is set: "
                    "anyone who reaches this port can use the model; set --api-key (or "
                    "NANOSCHED_API_KEY) or bind 127.0.0.1", cfg.host)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="info",
                            timeout_graceful_shutdown=cfg.drain_timeout_s + UVICORN_SLACK_S)
    server = DrainingServer(config)
    server.nanosched_worker = worker  # for tests and the bench: the engine behind the app
    server.nanosched_name = served.name
    return server


def run_server(cfg: ServeConfig) -> None:
    """Serve until SIGINT/SIGTERM, then drain."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="nanosched: %(message)s")
    build_server(cfg).run()
