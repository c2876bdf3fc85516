"""The request scheduler: waiting and running requests, admission, preemption and every change
to the KV pages of a request; the engine asks it for each batch and hands back what the batch
sampled (`update_from_output`), so the engine itself plans and frees no page.

Batches (NanoFlow §4.2.1): a fixed dense batch, decode first (rows rounded up to `decode_align`,
a CUDA-graph bucket's), then prompt chunks (continuing prefills, then new requests, first come
first served) until `dense_batch` tokens. Admission ("use", "reserve", "predict") and preemption
by recompute or swap go through runtime/kv_pool.py (`KVPool`). Prefix caching (`prefix_seed`):
an admitted request takes the cached full pages of its prompt's longest known prefix and
prefills after them (never its last token); a fully written page is indexed by its content hash
(models/prefix.py, models/kvcache.py); a request whose next page another is prefilling waits.

More in docs/admission.md and docs/runtime.md, module notes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanosched.errors import ConfigError
from nanosched.models.batch import SeqChunk
from nanosched.models.bucket import round_up
from nanosched.models.cascade import group_order, uses_cascade
from nanosched.models.kvcache import KVCache
from nanosched.models.prefix import page_hash, prefix_seed
from nanosched.runtime.kv_pool import KVPool, PreemptStats, make_pool
from nanosched.runtime.predict import OutputLengths
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
        return self.is_decode or self.start + self.num_tokens == self.request.prefill_len


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


@dataclass
class SchedulerStats:
    batches: int = 0  # non-empty batches formed
    full_batches: int = 0  # of those, batches that left no row of the dense batch unused
    prefix_queries: int = 0  # prompt (prefill) tokens of admitted requests looked up
    prefix_hits: int = 0  # of those, tokens found in the prefix cache (not computed)


class RequestScheduler:
    """Forms each iteration's batch, decides admission and preemption; knows nothing of the
    model. `pool` None: the "reserve" policy; else the pool's, "use" or "predict"
    (docs/admission.md). `kv`: the cache whose pages `plan`, `update_from_output` and `abort`
    take and free, each change also appended to `journal` when given (tp > 1: the other
    ranks replay it); None for the policy alone, its caller planning the batches.
    `prefix_seed`: the hash page 0 chains from (models/prefix.py); None: no prefix caching.
    `group_decodes` (cascade decode attention): decode entries of one first page side by side
    (models/cascade.py `group_order`); every later step reads the batch in that order."""

    def __init__(self, dense_batch: int, kv_capacity_pages: int, page_size: int,
                 max_context: int, decode_align: int = 1, pool: KVPool | None = None,
                 kv: KVCache | None = None, journal: list[tuple] | None = None,
                 prefix_seed: int | None = None, group_decodes: bool = False) -> None:
        if dense_batch < 1:
            raise ConfigError(f"--dense-batch must be positive, got {dense_batch}")
        if decode_align < 1:
            raise ConfigError(f"decode alignment must be positive, got {decode_align}")
        self.dense_batch = dense_batch
        self.decode_align = decode_align
        self.capacity_pages = kv_capacity_pages
        self.page_size = page_size
        self.max_context = max_context
        self.pool = pool
        self.kv = kv
        self.journal = journal
        self.prefix_seed = prefix_seed if kv is not None else None
        self.group_decodes = group_decodes and kv is not None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.output_lengths = OutputLengths()  # of ended requests, for "predict"

    @classmethod
    def for_engine(cls, model: Any, kv: KVCache, cfg: Any, max_context: int, decode_align: int,
                   journal: list[tuple] | None = None) -> RequestScheduler:
        """The scheduler of an engine's cache under `cfg` (an `EngineConfig`: dense batch,
        pages, admission), its page changes journaled at tp > 1."""
        pool = make_pool(model, kv, cfg.admission, journal)
        seed = prefix_seed(model.spec.name, cfg.model, cfg.weights, cfg.seed, cfg.dtype,
                           str(getattr(model, "dtype", "")), cfg.kv_dtype, cfg.quantization,
                           cfg.tp, cfg.page_size) if cfg.prefix_caching else None
        return cls(cfg.dense_batch, cfg.num_pages, cfg.page_size, max_context,
                   decode_align=decode_align, pool=pool, kv=kv, journal=journal,
                   prefix_seed=seed, group_decodes=uses_cascade(model))

    @property
    def policy(self) -> str:
        return "reserve" if self.pool is None else self.pool.cfg.policy

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

    def _remaining(self, r: Request) -> int:
        """Tokens `r` is expected to generate still: all it may ("reserve"), or the mean
        remainder of ended requests that got as far ("predict", runtime/predict.py)."""
        if self.policy == "predict":
            return self.output_lengths.remaining(r.num_output, r.params.max_tokens)
        return max(0, r.params.max_tokens - r.num_output)

    def predicted_peak_pages(self, extra: Request | None = None) -> int:
        reqs = self.running + ([extra] if extra is not None else [])
        decoding = [r for r in reqs if not r.is_prefilling]
        held = [r.prompt_len + r.num_output for r in decoding]
        remaining = [self._remaining(r) for r in decoding]
        prefilling = sum(r.prompt_len + r.num_output + self._remaining(r)
                         for r in reqs if r.is_prefilling)
        return math.ceil((prefilling + peak_kv_tokens(held, remaining)) / self.page_size) + \
            len(reqs)

    def _can_admit(self, req: Request, hit: list[int]) -> bool:
        if len(self.running) >= self.dense_batch:
            return False
        if self.pool is None:
            return self.predicted_peak_pages(req) <= self.capacity_pages
        alone = not self.running
        refs = self.pool.kv.allocator.refs
        if not self.pool.can_admit(req, alone, sum(refs[p] > 0 for p in hit)):
            return False
        return (alone or self.policy != "predict" or
                self.predicted_peak_pages(req) <= self.capacity_pages)

    # ---- the "use" policy: pages for this step's decodes -----------------------------------
    def _make_room(self) -> bool:
        """Free the pages of requests with every token sampled, then give each decode its page,
        preempting the newest page holders (docs/admission.md). True if any was preempted."""
        pool = self.pool
        pool.begin_step()
        for r in self.running:
            if r.num_output >= r.params.max_tokens:
                pool.release(r)
        preempted: set[int] = set()
        for r in list(self.running):  # oldest first; victims are newer, so not yet visited
            if id(r) in preempted:
                continue
            while pool.decode_need(r) > pool.num_free:
                victim = self._newest_holder(r)
                self.running.remove(victim)
                self.waiting.appendleft(victim)
                pool.preempt(victim)
                victim.num_cached_pages = 0
                preempted.add(id(victim))
                if victim is r:
                    break
            else:
                pool.reserve_decode(r)
        return bool(preempted)

    def _newest_holder(self, r: Request) -> Request:
        """The most recently admitted running request after `r` that holds pages, else `r`."""
        for v in reversed(self.running):
            if v is r:
                return r
            if self.pool.held(v) > 0:
                return v
        return r

    # ---- formation -------------------------------------------------------------------------
    def form(self, now_s: float = math.inf) -> Batch:
        """The next batch: decodes, continuing prefills, then new requests that fit."""
        preempted = self._make_room() if self.pool is not None else False
        entries = [BatchEntry(r, r.prompt_len + r.num_output - 1, 1, True)
                   for r in self.running if not r.is_prefilling and not r.finished
                   and r.num_output < r.params.max_tokens]
        if self.group_decodes and len(entries) > 1:  # rows of a shared first page side by side
            order = group_order([(self.kv.tables.get(e.request.request_id) or [-1])[0]
                                 for e in entries])
            entries = [entries[i] for i in order]
        # decode rows are counted rounded up to `decode_align` (a CUDA-graph bucket pads them)
        budget = self.dense_batch - min(round_up(len(entries), self.decode_align),
                                        self.dense_batch)
        for r in self.running:
            if budget == 0:
                break
            if r.is_prefilling:
                budget -= self._chunk(entries, r, budget)
        while (not preempted and budget > 0 and self.waiting and
               self.waiting[0].arrival_s <= now_s):
            hit = self._prefix_hit(self.waiting[0])
            if self._prefix_pending(self.waiting[0], hit) or \
                    not self._can_admit(self.waiting[0], hit):
                break  # first come first served: later requests wait behind it
            r = self.waiting.popleft()
            self.running.append(r)
            self._share_prefix(r, hit)
            if self.pool is not None and self.pool.admit(r):
                continue  # swapped in: runs from the next step, once its copy is done
            budget -= self._chunk(entries, r, budget)
        if entries:
            self.stats.batches += 1
            self.stats.full_batches += budget == 0
        return Batch(tuple(entries))

    # ---- prefix caching --------------------------------------------------------------------
    def _page_tokens(self, r: Request, page: int) -> list[int]:
        """Token ids of `r`'s full page `page` (prompt, then outputs)."""
        start, end = page * self.page_size, (page + 1) * self.page_size
        if end <= r.prompt_len:
            return r.prompt_ids[start:end]
        head = r.prompt_ids[start:] if start < r.prompt_len else []
        return head + r.output_ids[max(0, start - r.prompt_len):end - r.prompt_len]

    def _hashes(self, r: Request, pages: int) -> list[int]:
        """The content hashes of `r`'s first `pages` full pages (those tokens are known)."""
        hashes = r.page_hashes
        while len(hashes) < pages:
            parent = hashes[-1] if hashes else self.prefix_seed
            hashes.append(page_hash(parent, self._page_tokens(r, len(hashes))))
        return hashes

    def _prefix_hit(self, r: Request) -> list[int]:
        """Cached pages of `r`'s longest cached prefix, its last prefill token excluded (its
        logits must be computed); none without prefix caching or for a swapped-out request."""
        if self.prefix_seed is None or self.kv.num_held(r.request_id) or \
                (self.pool is not None and self.pool.swapped(r)):
            return []
        pages = self._shareable_pages(r)
        return self.kv.allocator.lookup(self._hashes(r, pages)[:pages])

    def _shareable_pages(self, r: Request) -> int:
        """Full pages of `r`'s prefill that a cached prefix may cover: its tokens known on the
        host, the last prefill token left out (its logits must be computed)."""
        return min(r.prefill_len - 1, r.prompt_len + len(r.output_ids)) // self.page_size

    def _prefix_pending(self, r: Request, hit: list[int]) -> bool:
        """Whether the page after `r`'s cached prefix is being prefilled by a running request
        (same hash, not yet indexed): `r` then waits to share it rather than compute it again
        (choices of one prompt, n > 1, admitted together)."""
        i = len(hit)
        if self.prefix_seed is None or i >= min(self._shareable_pages(r), len(r.page_hashes)):
            return False
        h = r.page_hashes[i]
        return any(q.is_prefilling and q.num_cached_pages <= i < len(q.page_hashes) and
                   q.page_hashes[i] == h for q in self.running)

    def _share_prefix(self, r: Request, hit: list[int]) -> None:
        """Admit `r` with its cached prefix: its block table starts with `hit`, its prefill
        after them; counts the lookup's tokens."""
        r.num_cached_pages = 0
        if self.prefix_seed is None or (self.pool is not None and self.pool.swapped(r)):
            return
        tokens = len(hit) * self.page_size
        self.stats.prefix_queries += r.prefill_len
        self.stats.prefix_hits += tokens
        if hit:
            self.kv.share(r.request_id, hit, tokens)
            self._log("share", r.request_id, tuple(hit), tokens)
            r.num_prefilled, r.num_cached_pages = tokens, len(hit)

    def _cache_pages(self, r: Request) -> None:
        """Index `r`'s pages that are fully written and whose tokens are all known on the host
        by their content hashes (another holds the hash already: this one stays unindexed)."""
        if self.prefix_seed is None or r.finish_reason == "error":
            return
        table = self.kv.tables.get(r.request_id)
        if not table:
            return
        known = min(self.kv.length(r.request_id), r.prompt_len + len(r.output_ids))
        full = min(known // self.page_size, len(table))
        if full <= r.num_cached_pages:
            return
        hashes = self._hashes(r, full)
        for i in range(r.num_cached_pages, full):
            if self.kv.register(table[i], hashes[i]):
                self._log("register", table[i], hashes[i])
        r.num_cached_pages = full

    def _log(self, *op: Any) -> None:
        if self.journal is not None:
            self.journal.append(op)

    @staticmethod
    def _chunk(entries: list[BatchEntry], r: Request, budget: int) -> int:
        n = min(budget, r.prefill_len - r.num_prefilled)
        entries.append(BatchEntry(r, r.num_prefilled, n, False))
        return n

    def retire(self, finished: list[Request]) -> None:
        """Drop ended requests: running ones, and preempted ones whose last token in flight
        ended them while they waited (async loop)."""
        done = {id(r) for r in finished}
        for r in finished:
            self.output_lengths.record(len(r.output_ids))
        self.running = [r for r in self.running if id(r) not in done]
        if any(id(r) in done for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if id(r) not in done)
        if self.pool is not None:
            for r in finished:
                self.pool.drop(r)

    def remove(self, request_id: int) -> Request | None:
        """Take a request out of the queue or the running set (an abort); None if absent."""
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                if self.pool is not None:
                    self.pool.drop(r)
                return r
        for r in self.running:
            if r.request_id == request_id:
                self.retire([r])
                return r
        return None

    # ---- the engine's side: pages of the batch, and what it sampled ------------------------
    def plan(self, chunks: list[tuple[int, int, bool]]) -> list[SeqChunk]:
        """The batch's chunks (request id, tokens, is decode) planned into the cache: positions,
        slots and block tables (rank 0's own batch, or at tp > 1 a worker's copy of it)."""
        return self.kv.plan_chunks(chunks)

    def launched(self, batch: Batch) -> None:
        """Advance the requests of a batch just launched: its prompt chunks count as prefilled
        and each entry that samples has one more token in flight (`pending`)."""
        for e in batch.entries:
            if not e.is_decode:
                e.request.num_prefilled += e.num_tokens
            if e.samples:
                e.request.pending += 1
            self._cache_pages(e.request)

    def update_from_output(self, samplers: list[Request], tokens: list[int], now_s: float,
                           eos_ids: frozenset[int],
                           on_token: Callable[[Request, int], None] | None = None
                           ) -> list[Request]:
        """Hand back a batch's sampled tokens (one per sampling request, in order; -1: its
        logits were not finite): append each, end a request at max_tokens, at an EOS it does
        not ignore or in error, free the pages of those that ended and retire them. A token
        of a request that already ended (the async loop's one past its end) is dropped.
        Returns the requests that ended."""
        ended = []
        for r, tok in zip(samplers, tokens, strict=True):
            r.pending -= 1
            if r.finished:
                continue  # ended with EOS one iteration ago; this token is past the end
            if tok < 0:  # its logits were not finite: this request alone ends, in error
                r.finish_reason, r.finished, r.finish_s = "error", True, now_s
                ended.append(r)
                continue
            r.output_ids.append(tok)
            if on_token is not None:
                on_token(r, tok)
            if r.first_token_s is None:
                r.first_token_s = now_s
            if len(r.output_ids) >= r.params.max_tokens:
                r.finish_reason = "length"
            elif tok in eos_ids and not r.params.ignore_eos:
                r.finish_reason = "stop"
            else:
                continue
            r.finished, r.finish_s = True, now_s
            ended.append(r)
        for r in ended:
            self._cache_pages(r)  # a decode-filled last page whose token was in flight
            self._release(r.request_id)
        self.retire(ended)
        return ended

    def abort(self, request_id: int, now_s: float = 0.0) -> Request | None:
        """End a waiting or running request (`finish_reason` "abort" at `now_s`) and free its
        KV pages; returns it (None when no such request is waiting or running)."""
        req = self.remove(request_id)
        if req is None:
            return None
        self._release(request_id)
        req.finished, req.finish_reason, req.finish_s = True, "abort", now_s
        return req

    def _release(self, request_id: int) -> None:
        self.kv.release(request_id)
        self._log("release", request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def reset_stats(self) -> None:
        """Count batches and preemptions afresh (after a benchmark's warm-up)."""
        self.stats = SchedulerStats()
        if self.kv is not None:
            self.kv.allocator.evictions = 0
        if self.pool is not None:
            self.pool.stats = PreemptStats()

    def report(self) -> dict[str, Any]:
        """The admission policy; the share of batches that left no row of the dense batch unused
        (decode rows rounded up to `decode_align` count as used); preemptions by kind."""
        s = self.stats
        return {"admission": self.policy, "full_batch_share": s.full_batches / max(1, s.batches),
                "preemptions": (self.pool.stats if self.pool else PreemptStats()).as_dict(),
                "prefix_cache": self.prefix_report()}

    def prefix_report(self) -> dict[str, Any]:
        """Prefix caching: on or off, prompt tokens looked up and found (since the last
        `reset_stats`), their ratio (0 with no query), cached pages evicted in all."""
        s = self.stats
        return {"enabled": self.prefix_seed is not None, "queries_tokens": s.prefix_queries,
                "hits_tokens": s.prefix_hits,
                "hit_rate": s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0,
                "evicted_pages": self.kv.allocator.evictions if self.kv is not None else 0}
