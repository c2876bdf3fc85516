"""`nanosched serve`: the FastAPI app around an `EngineWorker`.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with
`"stream": true`, ending with `data: [DONE]`), GET /v1/models, /health (503 once the engine
failed), /metrics (Prometheus text), and what a router asks of a replica (`fleet.py`):
/server_info, /model_info (each also as /get_...), /get_load. Every error body is OpenAI's
`{"error": {...}}`. With an API key the /v1/ routes, /server_info and /model_info need
`Authorization: Bearer <key>` (401 otherwise) and the generated API pages (/docs, /redoc,
/openapi.json) are off; /health, /metrics and /get_load stay open for probes.
A 429 (queue full) carries `Retry-After`. A body must be JSON: a Content-Type other than
application/json (or `+json`) gets 415; none at all is read as JSON, as FastAPI does. A number
too long to convert (more than Python's 4,300 digits) is a 400, as is invalid JSON. A client
that leaves while it sends the body is logged in one line, not as an error. How the server
starts, drains and stops is in `lifecycle.py`; the answers themselves in `handler.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from nanosched.runtime.server import fleet
from nanosched.runtime.server.handler import Handler
from nanosched.runtime.server.protocol import (
    MAX_NESTING,
    ApiError,
    Job,
    check_nesting,
    parse_chat,
    parse_completion,
)
from nanosched.runtime.server.responses import render_metrics
from nanosched.runtime.server.startup import DEFAULT_MAX_REQUEST_BYTES, Served
from nanosched.runtime.server.statslog import StatsLogger
from nanosched.runtime.server.worker import EngineWorker

log = logging.getLogger("nanosched.serve")
CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection: nobody reads it


class _AsciiJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error may echo text no UTF-8 encoder accepts."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _error(exc: ApiError) -> JSONResponse:
    return _AsciiJSON(exc.body(), status_code=exc.status, headers=exc.headers)


def _internal(request: Request, exc: Exception) -> JSONResponse:
    """Any exception no check foresaw: logged with its traceback, answered as a JSON 500.

    Starlette raises the exception again after this answer and uvicorn then closes the
    connection, so the answer says `Connection: close`: a keep-alive client that reused the
    connection at once would write its next request into the closing socket (a reset)."""
    log.error("%s %s failed", request.method, request.url.path,
              exc_info=(type(exc), exc, exc.__traceback__))
    return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                           code="internal_error", kind="server_error",
                           headers={"Connection": "close"}))


def _client_left(request: Request, _: ClientDisconnect) -> Response:
    """The client closed the connection before its body was all sent: one info line."""
    log.info("%s %s: the client left before sending the whole body", request.method,
             request.url.path)
    return Response(status_code=CLIENT_CLOSED)


def _check_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (or not declared at all)."""
    given = request.headers.get("content-type")
    if given is None:
        return
    kind = given.split(";", 1)[0].strip().lower()
    if kind != "application/json" and not kind.endswith("+json"):
        raise ApiError(415, f"Content-Type {given[:80]!r} is not JSON: send the body as JSON "
                            f"with 'Content-Type: application/json'",
                       code="unsupported_media_type")


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
    """The body as JSON, refused with 400 when it is not UTF-8 JSON, nests too deep, or holds
    an integer too long to convert (Python refuses more than 4,300 digits)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})",
                       code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, f"the request body nests more than {MAX_NESTING} levels of "
                            f"arrays and objects", code="invalid_body") from None
    except ValueError as exc:  # int digits limit: no field takes a number that long
        raise ApiError(400, f"the request body holds a number too long to read ({exc})",
                       code="invalid_json") from None
    check_nesting(body)
    return body


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

    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if api_key else {}
    app = FastAPI(title="nanosched", lifespan=lifespan, **docs)
    handler = Handler(served, worker)
    app.add_exception_handler(ApiError, lambda _, exc: _error(exc))
    app.add_exception_handler(ClientDisconnect, _client_left)
    app.add_exception_handler(Exception, _internal)
    app.add_exception_handler(HTTPException, lambda _, exc: _error(
        ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404
                 else None)))

    async def job(request: Request, parse: Callable[..., Job]) -> Job:
        """Read the body (bounded), then decode, validate and tokenize it in a worker thread:
        a huge prompt takes seconds to tokenize, and the event loop must keep serving."""
        _authorize(request, api_key)  # before the body is read
        _check_content_type(request)
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

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info(request: Request) -> dict[str, Any]:
        _authorize(request, api_key)
        return fleet.server_info(served, handler.limits.context, worker.max_queue)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info(request: Request) -> dict[str, Any]:
        _authorize(request, api_key)
        return fleet.model_info(served)

    @app.get("/get_load")
    async def load() -> list[dict[str, int]]:
        return fleet.load(worker.snapshot(), served.engine.scheduler.page_size)

    return app


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
