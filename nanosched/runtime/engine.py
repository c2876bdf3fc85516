"""The serving engine (NanoFlow §4.2.1): `step()` = form batch -> run the scheduler -> post-process.

A fixed dense batch per iteration (decode first, chunked prefill after; see batcher.py, which
also admits requests and preempts them when KV pages run out, as `config.admission` says). The
model step goes through a scheduling strategy (`Sequential` by default; any `OpScheduler`), with
a fallback strategy for batches the main one has nothing for (`OpScheduler.pick`: a schedule
set without an entry for the batch's shape); `stats` counts iterations that ran a pipeline, ran
sequentially by the strategy's decision, and fell back.

Asynchronous loop. With `config.async_loop` the CPU forms and launches batch i+1 before it reads
back batch i's tokens: a decode whose previous token is still on the device takes it from the
device tensor of the last iteration, and a request that ended with EOS in batch i is seen one
iteration late (its extra token is dropped). Without a GPU both loops give the same tokens. A
step waits for the GPU only there, on batch i's event: every host value it sends goes through
pinned memory (`kernels.common.host_to_device`) and sampling is told on the host whether any row
samples at random, since a blocking copy or the truth of a device tensor would wait for the
forward just launched and leave the GPU idle while the CPU post-processes and forms the next
batch (tests/gpu/test_graphs_gpu.py checks a replayed step under torch's sync debug mode).

CUDA graphs (`graphs="on"`). Each batch is laid out in a bucket (decode rows rounded up to
`graph_align`, then prompt chunks; models/bucket.py) and replayed from a CUDA graph captured per
(strategy, bucket) at the bucket's first batch (runtime/graphs.py); batches no bucket holds run
eagerly. `graphs="layout"` lays batches out the same way but runs them eagerly (the CPU tests of
what a graph replays). `stats.graphs` counts captures, replays and padding.

Serving hooks. `on_token(request, token)`, when given, is called once for every token appended
to a request's output, in order, during post-processing. `abort(request_id)` ends a request
wherever it is: a waiting one leaves the queue (a swapped-out one's host copy is dropped); a
running one is retired and its KV pages are freed at once. A token of it still in flight
(async loop) is dropped when read back, as a token past EOS is. Aborted requests end with
`finish_reason == "abort"` and are not in `finished`. A request whose logits are not finite
(NaN or +inf) cannot be sampled: it ends with `finish_reason == "error"` (pages freed, in
`finished`) while the rest of the batch goes on.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch

from nanosched.errors import ConfigError
from nanosched.kernels.common import host_to_device
from nanosched.models.batch import BatchMeta
from nanosched.runtime.backend import Backend
from nanosched.runtime.batcher import Batch, Batcher
from nanosched.runtime.config import GRAPH_MODES, EngineConfig
from nanosched.runtime.device import CudaDevice, SerialDevice
from nanosched.runtime.graphs import BucketRunner, GraphStats
from nanosched.runtime.modelprogram import model_program
from nanosched.runtime.preempt import make_pool
from nanosched.runtime.program import LaunchConfig
from nanosched.runtime.requests import Request
from nanosched.runtime.sampling import sample
from nanosched.runtime.scheduler import OpScheduler, run_program
from nanosched.runtime.strategies import Sequential


@dataclass
class EngineStats:
    iterations: int = 0
    tokens: int = 0  # prompt + decode tokens processed
    prefill_tokens: int = 0  # of which prompt (prefill) tokens
    fallbacks: int = 0  # iterations the strategy had nothing for (its fallback ran them)
    pipelined: int = 0  # iterations a pipelining strategy ran (a replayed schedule, two_batch)
    sequential: int = 0  # iterations the strategy ran one op after another (by its decision)
    shapes: Counter[tuple[int, int]] = field(default_factory=Counter)  # (D rows, T rows) run
    batch_sizes: list[int] = field(default_factory=list)
    # with time_forwards: (strategy name, forward time in ms) per iteration
    forward_ms: list[tuple[str, float]] = field(default_factory=list)
    graphs: GraphStats | None = None  # with graphs="on" or "layout"
    # with gpu_timeline on a GPU: CUDA events before and after each iteration's GPU work
    gpu_marks: list[tuple[Any, Any]] = field(default_factory=list)
    # and around each forward (its batch's metadata writes and the layers, not the LM head
    # and sampling), with the (D rows, T rows) shape it ran at
    forward_marks: list[tuple[tuple[int, int], Any, Any]] = field(default_factory=list)


def busy_and_idle(spans: list[tuple[float, float]]) -> tuple[float, float]:
    """(busy, idle) of a stream over iterations whose work ran from start to end (in order, one
    clock): busy the sum of the spans, idle the gaps between an end and the next start, when
    the GPU had finished one iteration and the CPU had not yet queued the next."""
    busy = sum(end - start for start, end in spans)
    idle = sum(max(0.0, nxt - end) for (_, end), (nxt, _) in pairwise(spans))
    return busy, idle


@dataclass
class _Launched:
    """An iteration in flight: which requests sample, and their tokens on the device."""

    samplers: list[Request]
    tokens: torch.Tensor  # [n] int64 on the device
    host: torch.Tensor  # [n] int64, pinned on CUDA
    ready: Any  # CUDA event (None on CPU)


class Engine:
    """`Engine(model, config, strategy=..., ...)`: the settings come resolved in `config`
    (`loader.load_engine` resolves them from flags); the objects it runs with come beside it:
    the strategy and its fallback (Sequential by default), the stream device (CUDA streams or
    the CPU's serial device by default), per-stream launch configs, and `on_token`."""

    def __init__(self, model: Any, config: EngineConfig, *,
                 strategy: OpScheduler | None = None, fallback: OpScheduler | None = None,
                 device: Any = None, stream_configs: dict[str, LaunchConfig] | None = None,
                 on_token: Callable[[Request, int], None] | None = None) -> None:
        cfg = config
        if cfg.dense_batch is None or cfg.num_pages is None:
            raise ConfigError("EngineConfig.dense_batch and num_pages must be set (the loader "
                              "resolves them: nanosched.runtime.loader.load_engine)")
        if cfg.graphs not in GRAPH_MODES:
            raise ConfigError(f"graphs must be 'off', 'on' or 'layout', got {cfg.graphs!r}")
        if cfg.graphs == "on" and model.device.type != "cuda":
            raise ConfigError("CUDA graphs need a CUDA model; use graphs='layout' on the CPU")
        self.config = cfg
        self.model = model
        self.is_cuda = model.device.type == "cuda"
        self.ws = model.new_workspace(cfg.dense_batch, cfg.num_pages, cfg.page_size,
                                      cfg.kv_dtype)
        max_context = cfg.max_context or model.spec.max_position_embeddings
        align = cfg.graph_align if cfg.graphs != "off" else 1
        pool = make_pool(model, self.ws.kv, cfg.admission)
        self.batcher = Batcher(cfg.dense_batch, cfg.num_pages, cfg.page_size, max_context,
                               decode_align=align, pool=pool)
        self.strategy = strategy or Sequential()
        self.fallback = fallback or Sequential()
        self.stream_configs = stream_configs
        self.backend = Backend(device or (CudaDevice() if self.is_cuda else SerialDevice()))
        self.time_forwards = cfg.time_forwards
        self.gpu_timeline = cfg.gpu_timeline and self.is_cuda
        self.on_token = on_token
        self.eos_ids = frozenset(cfg.eos_ids or ())
        self.generator = torch.Generator(device=model.device).manual_seed(cfg.seed)
        # default: asynchronous on a GPU; on the CPU it runs the same code with no overlap
        self.async_loop = self.is_cuda if cfg.async_loop is None else cfg.async_loop
        self.stats = EngineStats()
        self.graphs: BucketRunner | None = None
        if cfg.graphs != "off":
            self.graphs = BucketRunner(model, self.ws, self.backend, self.strategy,
                                       fallback=self.fallback, align=align,
                                       max_pages=-(-max_context // cfg.page_size),
                                       capture=cfg.graphs == "on", stream_configs=stream_configs)
            self.stats.graphs = self.graphs.stats
        self._in_flight: _Launched | None = None
        self._pending_row: dict[int, int] = {}  # request id -> row in the in-flight tokens
        self.finished: list[Request] = []
        self.clock = time.perf_counter
        self.t0 = self.clock()

    # ---- public ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.batcher.add(req)

    def step(self) -> list[Request]:
        """One iteration: form batch -> run the scheduler -> post-process. Returns the
        requests whose end became known in this step."""
        batch = self.batcher.form(self.clock() - self.t0)
        if not batch.entries and self._in_flight is None:
            time.sleep(1e-4)  # waiting for arrivals
        launched = self._run(batch) if batch.entries else None
        previous, self._in_flight = self._in_flight, launched
        if not self.async_loop:
            previous, self._in_flight = launched, None
        return self._post_process(previous) if previous is not None else []

    @property
    def has_work(self) -> bool:
        """Whether a request is waiting, running, or has a token in flight."""
        return self.batcher.has_work or self._in_flight is not None

    def abort(self, request_id: int) -> Request | None:
        """End a waiting or running request and free its KV pages; returns it (None when no
        such request is waiting or running)."""
        req = self.batcher.remove(request_id)
        if req is None:
            return None
        self.ws.kv.release(request_id)
        self._pending_row.pop(request_id, None)
        req.finished, req.finish_reason, req.finish_s = True, "abort", self.clock() - self.t0
        return req

    def run_to_completion(self, max_steps: int = 10**9) -> list[Request]:
        for _ in range(max_steps):
            if not self.has_work:
                break
            self.step()
        return self.finished

    # ---- run the scheduler -----------------------------------------------------------------
    def _run(self, batch: Batch) -> _Launched:
        ws, dev = self.ws, self.model.device
        start = self._gpu_mark()
        seqs = ws.kv.plan_chunks([(e.request.request_id, e.num_tokens, e.is_decode)
                                  for e in batch.entries])
        bucket = self.graphs.bucket(seqs) if self.graphs else None
        # rows: decode entries first; with a bucket, prompt chunks start at its first prefill row
        row = 0
        prefill_row = bucket.num_decode if bucket else batch.num_decode
        n = bucket.num_tokens if bucket else batch.num_tokens
        ids, from_device, rows, segments = [0] * n, [], [], []
        for e in batch.entries:
            r = e.request
            if not e.is_decode and row < prefill_row:
                row = prefill_row
            if e.is_decode and r.pending:
                from_device.append((row, self._pending_row[r.request_id]))
            elif e.is_decode:
                ids[row] = r.output_ids[-1]
            else:
                ids[row:row + e.num_tokens] = r.prefill_ids(e.start, e.num_tokens)
            segments.append((row, row + e.num_tokens, e.is_decode))
            row += e.num_tokens
            if e.samples:
                rows.append(row - 1)
        ws.token_ids[:n].copy_(host_to_device(ids, torch.int64, dev))
        if from_device:
            dst, src = zip(*from_device, strict=True)
            ws.token_ids.index_copy_(0, host_to_device(dst, torch.int64, dev),
                                     self._in_flight.tokens[host_to_device(src, torch.int64, dev)])
        timer = _ForwardTimer(self.is_cuda) if self.time_forwards else None
        forward_start = self._gpu_mark()
        if bucket is not None:
            entry = self.graphs.entry(bucket)
            strategy, fell_back = entry.strategy, entry.fell_back
            self.graphs.run(entry, seqs)
        else:
            if self.graphs:
                self.graphs.stats.unbucketed += 1
            meta = BatchMeta.build(seqs, ws.kv.page_size, dev)
            program = model_program(self.model, ws, meta, segments)
            picked = self.strategy.pick(program, batch.num_decode)
            strategy, fell_back = picked or self.fallback, picked is None
            run_program(program, strategy, self.backend, self.stream_configs)
        self.stats.shapes[(prefill_row, n)] += 1  # the bucket's rows, else the batch's
        if forward_start is not None:
            self.stats.forward_marks.append(((prefill_row, n), forward_start, self._gpu_mark()))
        self.stats.fallbacks += fell_back
        if not fell_back:
            self.stats.pipelined += strategy.pipelined
            self.stats.sequential += not strategy.pipelined
        if timer:
            self.stats.forward_ms.append((strategy.name, timer.stop()))
        launched = self._sample(batch, rows)
        if start is not None:
            self.stats.gpu_marks.append((start, self._gpu_mark()))
        return launched

    def _gpu_mark(self) -> Any:
        """With `gpu_timeline`: a timing event recorded on the current stream, else None."""
        if not self.gpu_timeline:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _sample(self, batch: Batch, rows: list[int]) -> _Launched:
        dev = self.model.device
        samplers = [e.request for e in batch.entries if e.samples]
        if samplers:
            logits = self.model.logits(self.ws, host_to_device(rows, torch.int64, dev))
            temps = [r.params.temperature for r in samplers]
            temp = host_to_device(temps, torch.float32, dev)
            top_p = host_to_device([r.params.top_p for r in samplers], torch.float32, dev)
            marked = sample(logits, temp, top_p, self.generator,  # -1: the row failed
                            any_random=any(t > 0 for t in temps))
            tokens = marked.clamp_min(0)  # what a decode on the device may read as its input
        else:  # every entry is a prompt chunk that does not end its prompt
            tokens = marked = torch.empty(0, dtype=torch.int64, device=dev)
        for e in batch.entries:
            if not e.is_decode:
                e.request.num_prefilled += e.num_tokens
        for i, r in enumerate(samplers):
            r.pending += 1
            self._pending_row[r.request_id] = i
        self.stats.iterations += 1
        self.stats.tokens += batch.num_tokens
        self.stats.prefill_tokens += batch.num_prefill
        self.stats.batch_sizes.append(batch.num_tokens)
        if not self.is_cuda:
            return _Launched(samplers, tokens, marked, None)
        host = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(marked, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _Launched(samplers, tokens, host, event)

    def gpu_timeline_report(self) -> dict[str, float] | None:
        """With `gpu_timeline`: the iterations recorded since the stats were last reset, the
        seconds the GPU spent on their work, and the seconds it sat between them waiting for
        the CPU (waits for the last iteration's end). None without a record."""
        marks = self.stats.gpu_marks
        if not marks:
            return None
        marks[-1][1].synchronize()
        t0 = marks[0][0]
        busy, idle = busy_and_idle([(t0.elapsed_time(s), t0.elapsed_time(e)) for s, e in marks])
        return {"iterations": len(marks), "busy_s": busy / 1e3, "idle_s": idle / 1e3}

    def forward_ms_by_shape(self) -> dict[tuple[int, int], list[float]]:
        """With `gpu_timeline`: the GPU time (ms) of each forward recorded since the stats were
        last reset, by the (D rows, T rows) shape it ran at (its graph bucket's, else its
        batch's): the metadata writes and the layers, as a schedule set prices a bucket (no LM
        head or sampling). Empty without a record."""
        out: dict[tuple[int, int], list[float]] = {}
        if self.stats.forward_marks:
            self.stats.forward_marks[-1][2].synchronize()
        for shape, start, end in self.stats.forward_marks:
            out.setdefault(shape, []).append(start.elapsed_time(end))
        return out

    # ---- post-process ----------------------------------------------------------------------
    def _post_process(self, launched: _Launched) -> list[Request]:
        if launched.ready is not None:
            launched.ready.synchronize()
        now = self.clock() - self.t0
        ended = []
        for r, tok in zip(launched.samplers, launched.host.tolist(), strict=True):
            r.pending -= 1
            if r.finished:
                continue  # ended with EOS one iteration ago; this token is past the end
            if tok < 0:  # its logits were not finite: this request alone ends, in error
                r.finish_reason, r.finished, r.finish_s = "error", True, now
                ended.append(r)
                continue
            r.output_ids.append(tok)
            if self.on_token is not None:
                self.on_token(r, tok)
            if r.first_token_s is None:
                r.first_token_s = now
            if len(r.output_ids) >= r.params.max_tokens:
                r.finish_reason = "length"
            elif tok in self.eos_ids and not r.params.ignore_eos:
                r.finish_reason = "stop"
            else:
                continue
            r.finished, r.finish_s = True, now
            ended.append(r)
        for r in ended:
            self.ws.kv.release(r.request_id)
            self._pending_row.pop(r.request_id, None)
        self.batcher.retire(ended)
        self.finished += ended
        return ended


class _ForwardTimer:
    """GPU time of one forward (CUDA events; wall time on the CPU). Reading it synchronises,
    so timed runs measure the forward, not the pipelined loop."""

    def __init__(self, is_cuda: bool) -> None:
        self.is_cuda = is_cuda
        if is_cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if not self.is_cuda:
            return (time.perf_counter() - self.t0) * 1e3
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self.start.elapsed_time(end)
