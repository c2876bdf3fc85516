"""Batch formation (NanoFlow §4.2.1): a fixed dense batch, decode first, chunked prefill after.

Each iteration holds at most `dense_batch` tokens: one decode token per running request that has
finished its prompt, then prompt chunks (continuing prefills first, then newly admitted requests,
first come first served) until the batch is full. With `decode_align` > 1 the decode tokens take
room rounded up to a multiple of it: the rows a CUDA-graph bucket pads them to
(models/bucket.py).

Admission by predicted peak KV memory. A decoding request i holds h_i tokens of KV and will
generate r_i more, one per iteration (decodes never wait), then free everything. Their usage t
iterations ahead is U(t) = sum_{i: r_i >= t} (h_i + t); it only grows between finishes, so its
peak is max over t in {0} U {r_i} of U(t), one sort and suffix sums. A request still in its
prompt may wait for chunks, so it is counted at its own peak P_i = prompt + max_tokens until it
decodes. The bound sum_prefilling P_i + max_t U(t), plus a page of slack per request for page
rounding, never grows as requests progress, so admitting a request only when the bound with it
fits the cache means a run never runs out of KV memory mid-way. A request whose own peak exceeds
the cache can never run and is rejected.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from nanosched.errors import ConfigError
from nanosched.models.bucket import round_up
from nanosched.runtime.requests import Request


@dataclass(frozen=True)
class BatchEntry:
    """A request's slice of the batch: `num_tokens` tokens from sequence position `start`."""

    request: Request
    start: int
    num_tokens: int
    is_decode: bool

    @property
    def samples(self) -> bool:
        """Whether this entry yields a new token (decode, or the prompt's last chunk)."""
        return self.is_decode or self.start + self.num_tokens == self.request.prompt_len


@dataclass(frozen=True)
class Batch:
    entries: tuple[BatchEntry, ...]  # decode entries first, then prefill chunks

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)

    @property
    def num_decode(self) -> int:
        return sum(e.is_decode for e in self.entries)

    @property
    def num_prefill(self) -> int:
        return self.num_tokens - self.num_decode


def peak_kv_tokens(held: list[int], remaining: list[int]) -> int:
    """max_t sum_{i: remaining_i >= t} (held_i + t), over t in {0} U remaining."""
    order = sorted(range(len(held)), key=lambda i: remaining[i])
    best, suffix_held, count = 0, sum(held), len(held)
    for i in order:  # at t = remaining[i] every request with remaining >= t is still there
        t = remaining[i]
        best = max(best, suffix_held + t * count)
        suffix_held -= held[i]
        count -= 1
    return max(best, sum(held))


class Batcher:
    """Forms each iteration's batch and decides admission; knows nothing of the model."""

    def __init__(self, dense_batch: int, kv_capacity_pages: int, page_size: int,
                 max_context: int, decode_align: int = 1) -> None:
        if dense_batch < 1:
            raise ConfigError(f"--dense-batch must be positive, got {dense_batch}")
        if decode_align < 1:
            raise ConfigError(f"decode alignment must be positive, got {decode_align}")
        self.dense_batch = dense_batch
        self.decode_align = decode_align
        self.capacity_pages = kv_capacity_pages
        self.page_size = page_size
        self.max_context = max_context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---- admission -------------------------------------------------------------------------
    def check_fits(self, req: Request) -> None:
        """Reject a request that can never run, naming its length and the limit."""
        if req.peak_tokens > self.max_context:
            raise ConfigError(f"request {req.request_id}: prompt ({req.prompt_len}) + max_tokens "
                              f"({req.params.max_tokens}) = {req.peak_tokens} exceeds the "
                              f"model's context of {self.max_context} tokens")
        need = math.ceil(req.peak_tokens / self.page_size) + 1
        if need > self.capacity_pages:
            raise ConfigError(f"request {req.request_id}: needs {req.peak_tokens} KV tokens "
                              f"({need} pages) but the cache holds "
                              f"{self.capacity_pages * self.page_size} tokens")

    def add(self, req: Request) -> None:
        self.check_fits(req)
        self.waiting.append(req)

    def predicted_peak_pages(self, extra: Request | None = None) -> int:
        reqs = self.running + ([extra] if extra is not None else [])
        decoding = [r for r in reqs if not r.is_prefilling]
        held = [r.prompt_len + r.num_output for r in decoding]
        remaining = [max(0, r.params.max_tokens - r.num_output) for r in decoding]
        prefilling = sum(r.peak_tokens for r in reqs if r.is_prefilling)
        return math.ceil((prefilling + peak_kv_tokens(held, remaining)) / self.page_size) + \
            len(reqs)

    def _can_admit(self, req: Request) -> bool:
        return (len(self.running) < self.dense_batch and
                self.predicted_peak_pages(req) <= self.capacity_pages)

    # ---- formation -------------------------------------------------------------------------
    def form(self, now_s: float = math.inf) -> Batch:
        """The next batch: decodes, continuing prefills, then new requests that fit."""
        entries = [BatchEntry(r, r.prompt_len + r.num_output - 1, 1, True)
                   for r in self.running if not r.is_prefilling and not r.finished
                   and r.num_output < r.params.max_tokens]
        # decode rows are counted rounded up to `decode_align` (a CUDA-graph bucket pads them)
        budget = self.dense_batch - min(round_up(len(entries), self.decode_align),
                                        self.dense_batch)
        for r in self.running:
            if budget == 0:
                break
            if r.is_prefilling:
                budget -= self._chunk(entries, r, budget)
        while budget > 0 and self.waiting and self.waiting[0].arrival_s <= now_s:
            if not self._can_admit(self.waiting[0]):
                break  # first come first served: later requests wait behind it
            r = self.waiting.popleft()
            self.running.append(r)
            budget -= self._chunk(entries, r, budget)
        return Batch(tuple(entries))

    @staticmethod
    def _chunk(entries: list[BatchEntry], r: Request, budget: int) -> int:
        n = min(budget, r.prompt_len - r.num_prefilled)
        entries.append(BatchEntry(r, r.num_prefilled, n, False))
        return n

    def retire(self, finished: list[Request]) -> None:
        done = {id(r) for r in finished}
        self.running = [r for r in self.running if id(r) not in done]

    def remove(self, request_id: int) -> Request | None:
        """Take a request out of the queue or the running set (an abort); None if absent."""
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                return r
        for r in self.running:
            if r.request_id == request_id:
                self.retire([r])
                return r
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
