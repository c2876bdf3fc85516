"""`Engine.step`'s page and token bookkeeping without a model, to test and compare admission.

`KVSim` drives the real `RequestScheduler`, `KVCache` and (under the "use" policy) `KVPool`
with host swap the way `Engine.step` does (form -> plan the batch into the cache -> sample ->
post-process; with `async_loop`, batch i's tokens are read back after batch i+1 is launched),
but its "model"
writes each token id into the one-element K slot of its position and, with `check`, reads a
request's whole context back from its pages, compares it with the request's tokens and derives
the next token from what it read. A page lost, overwritten, swapped back wrong or a prefill
that skips or repeats a token then shows as an error or a different output, at thousands of
requests a second. `stop_at` makes requests end early, as at an EOS (seen one iteration late
with `async_loop`, as the engine sees it). Without `check` the next token is a function of
(request, position) only: the fast mode `bench/analysis/admission_sim.py` runs a benchmark's
workload in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanosched.models.kvcache import KVCache
from nanosched.runtime.kv_pool import AdmissionConfig, KVPool
from nanosched.runtime.offload import SwapCost
from nanosched.runtime.request_scheduler import Batch, BatchEntry, RequestScheduler
from nanosched.runtime.requests import Request

VOCAB = 1000


class SimError(AssertionError):
    """The cache does not hold what a request wrote."""


@dataclass
class _Launched:
    samplers: list[Request]
    tokens: list[int]


def sim_cost(swap_favoured: bool) -> SwapCost:
    """A cost model under which `prefer_swap` always (or never) swaps a request with KV."""
    link = 1e12 if swap_favoured else 1.0
    return SwapCost(kv_bytes_per_token=4, flops_per_token=1e6, attn_flops_per_token2=0.0,
                    link_bytes_per_s=link, flops_per_s=1e12)


class KVSim:
    """The engine loop over a fake model (module docstring); `step()` returns ended requests."""

    def __init__(self, *, num_pages: int, page_size: int, dense_batch: int,
                 admission: AdmissionConfig, max_context: int = 1 << 20, decode_align: int = 1,
                 async_loop: bool = False, check: bool = True,
                 cost: SwapCost | None = None, stop_at: dict[int, int] | None = None) -> None:
        self.kv = KVCache(1, num_pages, 1, 1, torch.float32, page_size=page_size)
        pool = KVPool(self.kv, admission, cost or sim_cost(True)) \
            if admission.policy != "reserve" else None
        self.scheduler = RequestScheduler(dense_batch, num_pages, page_size, max_context,
                                        decode_align=decode_align, pool=pool)
        self.async_loop, self.check = async_loop, check
        self.stop_at = stop_at or {}  # request id -> output count whose last token is an EOS
        self.sampled: dict[int, list[int]] = {}  # request id -> tokens sampled "on the device"
        self._in_flight: _Launched | None = None
        self.finished: list[Request] = []
        self.batch_sizes: list[int] = []

    def add(self, r: Request) -> None:
        self.scheduler.add(r)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    def step(self) -> list[Request]:
        batch = self.scheduler.form()
        launched = self._run(batch) if batch.entries else None
        previous, self._in_flight = self._in_flight, launched
        if not self.async_loop:
            previous, self._in_flight = launched, None
        return self._post_process(previous) if previous is not None else []

    def run(self, max_steps: int) -> int:
        """Step until no work is left; returns the steps taken (SimError past `max_steps`)."""
        for n in range(max_steps):
            if not self.has_work:
                return n
            self.step()
        raise SimError(f"not done after {max_steps} steps: a deadlock or a livelock")

    # ---- the fake model --------------------------------------------------------------------
    def _run(self, batch: Batch) -> _Launched:
        seqs = self.kv.plan_chunks([(e.request.request_id, e.num_tokens, e.is_decode)
                                    for e in batch.entries])
        samplers, tokens = [], []
        for e, c in zip(batch.entries, seqs, strict=True):
            r = e.request
            token = self._write_and_read(e, c.block_table) if self.check else \
                (r.request_id * 7919 + (e.start + e.num_tokens) * 104729) % VOCAB
            if not e.is_decode:
                r.num_prefilled += e.num_tokens
            if e.samples:
                samplers.append(r)
                tokens.append(token)
        for r, t in zip(samplers, tokens, strict=True):
            r.pending += 1
            self.sampled.setdefault(r.request_id, []).append(t)
        self.batch_sizes.append(batch.num_tokens)
        return _Launched(samplers, tokens)

    def _write_and_read(self, e: BatchEntry, table: tuple[int, ...]) -> int:
        """Write the entry's token ids into its K slots (taken as the engine takes them: a
        decode's from the host, or the device's while in flight; a prefill's from the host),
        then check the whole context read back against the request's tokens; the next token."""
        r = e.request
        flat = self.kv.k.view(-1).numpy()  # one element per slot: [(P + 1) * S], shared
        seq = r.prompt_ids + self.sampled.get(r.request_id, [])  # the truth
        if e.is_decode:
            ids = [seq[-1] if r.pending else r.output_ids[-1]]
        else:
            ids = r.prefill_ids(e.start, e.num_tokens)
        end = e.start + e.num_tokens
        if end > len(seq) or len(ids) != e.num_tokens:
            raise SimError(f"request {r.request_id}: positions {e.start}..{end - 1} past its "
                           f"{len(seq)} tokens")
        flat[self._slots(table, e.start, e.num_tokens)] = ids
        cached = flat[self._slots(table, 0, end)].astype(np.int64)
        wrong = np.flatnonzero(cached != np.asarray(seq[:end]))
        if wrong.size:
            bad = int(wrong[0])
            raise SimError(f"request {r.request_id}: position {bad} holds {cached[bad]}, "
                           f"expected {seq[bad]}")
        weights = np.arange(1, end + 1) % 997  # position-weighted: order matters
        return int((cached + 1) @ weights) % VOCAB

    def _slots(self, table: tuple[int, ...], start: int, n: int) -> np.ndarray:
        s = self.kv.page_size
        pos = np.arange(start, start + n)
        return np.asarray(table)[pos // s] * s + pos % s

    def _post_process(self, launched: _Launched) -> list[Request]:
        ended = []
        for r, tok in zip(launched.samplers, launched.tokens, strict=True):
            r.pending -= 1
            if r.finished:
                continue
            r.output_ids.append(tok)
            if len(r.output_ids) >= r.params.max_tokens:
                r.finish_reason = "length"
            elif len(r.output_ids) == self.stop_at.get(r.request_id):
                r.finish_reason = "stop"
            else:
                continue
            r.finished = True
            ended.append(r)
        for r in ended:
            self.kv.release(r.request_id)
        self.scheduler.retire(ended)
        self.finished += ended
        return ended
