"""The answers of the completion routes: validated jobs become engine requests, and their
tokens become whole responses or server-sent event streams.

A request's choices (prompts x `n`) are each an engine request. More of them than the queue
bound (--max-queue) could ever hold is a 400 naming `n` (or `prompt`), never a 429 that a
retrying client would loop on. A client that goes away mid-request gets its request aborted
at once (KV pages and batch slot freed): a stream when Starlette cancels its generator, a
whole response when the task watching the connection sees `http.disconnect`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from nanosched.runtime.server.protocol import ApiError, Job, ModelLimits
from nanosched.runtime.server.responses import (
    chunk_event,
    completion_body,
    merge_choices,
    sse,
    usage_event,
)
from nanosched.runtime.server.startup import Served
from nanosched.runtime.server.text import Detokenizer, StopText
from nanosched.runtime.server.worker import EngineWorker, QueueFull, Unavailable, Update

RETRY_AFTER_S = 1  # 429: a queue slot frees as soon as one request is admitted


class Handler:
    """Turns validated jobs into engine requests and their answers."""

    def __init__(self, served: Served, worker: EngineWorker) -> None:
        self.served, self.worker = served, worker
        spec = served.spec
        self.limits = ModelLimits(served.name, spec.vocab_size, served_context(served.engine),
                                  served.aliases)

    def submit(self, job: Job) -> tuple[int, asyncio.Queue]:
        try:  # a request longer than the whole KV cache can never run
            self.served.engine.scheduler.check_fits(_probe(job))
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
        self._check_queue_bound(job)
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

    def _check_queue_bound(self, job: Job) -> None:
        """400 when the request's choices outnumber what the queue can ever hold: a 429 would
        send a retrying client round forever."""
        bound = self.worker.max_queue
        if job.num_choices <= bound:
            return
        param = "n" if job.n > 1 else "prompt"
        raise ApiError(400, f"{param}: {job.num_choices} choices ({max(1, len(job.prompts))} "
                            f"prompt(s) x n={job.n}) are {job.num_choices} engine requests, "
                            f"more than this server queues at once (--max-queue {bound}), so "
                            f"the request can never be accepted: send at most {bound} choices "
                            f"per request", param=param, code="exceeds_queue")

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
    `RequestScheduler.check_fits`). /v1/models advertises it as max_model_len, and a chat request
    without max_tokens gets what is left of it after the prompt."""
    b = engine.scheduler
    return max(1, min(b.max_context, (b.capacity_pages - 1) * b.page_size))


def _update_error(update: Update) -> ApiError:
    code = "unavailable" if update.status == 503 else "engine_failed"
    return ApiError(update.status, update.error or "", code=code, kind="server_error")


def _raise_error(update: Update) -> None:
    if update.error:
        raise _update_error(update)
