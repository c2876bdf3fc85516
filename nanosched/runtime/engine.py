"""The serving engine (NanoFlow §4.2.1): `step()` = form batch -> run the scheduler -> post-process.

The request scheduler (runtime/request_scheduler.py: admission, preemption, every KV page of a
request, as `config.admission` says) gives each batch, a fixed dense batch with decode first and
chunked prefill after, and takes back what it sampled; the engine plans and frees no page. The
model step goes through a scheduling strategy (`Sequential` by default; any `OpScheduler`), with
a fallback strategy for batches the main one has nothing for (`OpScheduler.pick`: a schedule
set without an entry for the batch's shape); `stats` counts iterations that ran a pipeline, ran
sequentially by the strategy's decision, and fell back.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nanosched.errors import ConfigError
from nanosched.kernels.common import host_to_device
from nanosched.models.batch import BatchMeta, SeqChunk
from nanosched.models.cascade import uses_cascade
from nanosched.runtime.backend import Backend
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.device import CudaDevice, SerialDevice
from nanosched.runtime.graphs import BucketRunner, check_graph_mode
from nanosched.runtime.layout import Layout, lay_out, write_token_ids
from nanosched.runtime.modelprogram import model_program
from nanosched.runtime.opsched import OpScheduler, pick_strategy, run_program
from nanosched.runtime.program import LaunchConfig
from nanosched.runtime.request_scheduler import Batch, RequestScheduler
from nanosched.runtime.requests import Request
from nanosched.runtime.sampling import sample, to_host
from nanosched.runtime.stats import EngineStats, ForwardTimer, forward_ms_by_shape, timeline_report
from nanosched.runtime.strategies import Sequential


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
                 on_token: Callable[[Request, int], None] | None = None,
                 link: Any = None) -> None:
        cfg = config
        if cfg.dense_batch is None or cfg.num_pages is None:
            raise ConfigError("EngineConfig.dense_batch and num_pages must be set (the loader "
                              "resolves them: nanosched.runtime.loader.load_engine)")
        check_graph_mode(cfg.graphs, model.device)
        self.config = cfg
        self.model = model
        self.is_cuda = model.device.type == "cuda"
        self.ws = model.new_workspace(cfg.dense_batch, cfg.num_pages, cfg.page_size,
                                      cfg.kv_dtype)
        max_context = cfg.max_context or model.spec.max_position_embeddings
        align = cfg.graph_align if cfg.graphs != "off" else 1
        # at tp > 1 on rank 0: the other ranks' end of this engine (runtime/ranks/group.py);
        # every change to the KV pages is journaled for them
        self.link = link
        journal = link.journal if link is not None else None
        # the request scheduler: waiting and running requests, admission, every KV page
        self.scheduler = RequestScheduler.for_engine(model, self.ws.kv, cfg, max_context, align,
                                                   journal)
        self.strategy = strategy or Sequential()
        self.fallback = fallback or Sequential()
        self.stream_configs = stream_configs
        self.backend = Backend(device or (CudaDevice() if self.is_cuda else SerialDevice()))
        self.gpu_timeline = cfg.gpu_timeline and self.is_cuda
        self.on_token = on_token
        self.eos_ids = frozenset(cfg.eos_ids or ())
        self.generator = torch.Generator(device=model.device).manual_seed(cfg.seed)
        # default: asynchronous on a GPU; on the CPU it runs the same code with no overlap
        self.async_loop = self.is_cuda if cfg.async_loop is None else cfg.async_loop
        self.stats = EngineStats()
        self.graphs = None if cfg.graphs == "off" else BucketRunner(
            model, self.ws, self.backend, self.strategy, fallback=self.fallback, align=align,
            max_pages=-(-max_context // cfg.page_size), capture=cfg.graphs == "on",
            stream_configs=stream_configs)
        self.stats.graphs = self.graphs.stats if self.graphs else None
        self._in_flight: _Launched | None = None
        self._pending_row: dict[int, int] = {}  # request id -> row in the in-flight tokens
        self.finished: list[Request] = []
        self.clock = time.perf_counter
        self.t0 = self.clock()

    # ---- public ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)

    def step(self) -> list[Request]:
        """One iteration: form batch -> run the scheduler -> post-process. Returns the
        requests whose end became known in this step."""
        batch = self.scheduler.form(self.clock() - self.t0)
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
        return self.scheduler.has_work or self._in_flight is not None

    def abort(self, request_id: int) -> Request | None:
        """End a waiting or running request and free its KV pages; returns it (None when no
        such request is waiting or running)."""
        self._pending_row.pop(request_id, None)
        return self.scheduler.abort(request_id, self.clock() - self.t0)

    def run_on_ranks(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(self, *args)` here and, at tp > 1, on every other rank's engine (work whose
        collectives must pair up, e.g. a benchmark's timed forward; `fn` and `args` must
        pickle). Returns this rank's result."""
        if self.link is not None:
            self.link.call(fn, args)
        return fn(self, *args)

    def run_to_completion(self, max_steps: int = 10**9) -> list[Request]:
        for _ in range(max_steps):
            if not self.has_work:
                break
            self.step()
        return self.finished

    # ---- run the scheduler -----------------------------------------------------------------
    def _run(self, batch: Batch) -> _Launched:
        ws = self.ws
        start = self._gpu_mark()
        num_decode = batch.num_decode
        chunks = [(e.request.request_id, e.num_tokens, e.is_decode) for e in batch.entries]
        samples = [e.samples for e in batch.entries]
        if self.link is not None:  # the other ranks start on this batch while this one lays it
            self.link.step(chunks, samples, num_decode)
        seqs = self.scheduler.plan(chunks)
        lay = self.lay_out(seqs, samples)
        write_token_ids(ws.token_ids, batch.entries, lay, self._pending_row,
                        self._in_flight.tokens if self._in_flight is not None else None)
        timer = ForwardTimer(self.is_cuda) if self.config.time_forwards else None
        forward_start = self._gpu_mark()
        strategy, fell_back = self.forward(seqs, lay, num_decode)
        marks = None if forward_start is None else (forward_start, self._gpu_mark())
        # the bucket's rows, else the batch's
        self.stats.count_forward((lay.prefill_row, lay.num_rows), strategy, fell_back, marks)
        if timer:
            self.stats.forward_ms.append((strategy.name, timer.stop()))
        launched = self._sample(batch, lay.rows)
        if start is not None:
            self.stats.gpu_marks.append((start, self._gpu_mark()))
        return launched

    def lay_out(self, seqs: list[SeqChunk], samples: list[bool]) -> Layout:
        """The rows of a planned batch: in its graph bucket (when one holds it), else packed."""
        return lay_out(seqs, samples, self.graphs.bucket(seqs) if self.graphs else None)

    def forward(self, seqs: list[SeqChunk], lay: Layout,
                num_decode: int) -> tuple[OpScheduler, bool]:
        """The batch's forward over its token ids in `ws.token_ids` (at tp > 1 rank 0's ids
        go to every rank first): a bucket's graph (or its eager run), else the strategy's
        pick for the batch. Returns the strategy that ran and whether it was the fallback."""
        ws = self.ws
        self.model.tp.broadcast(ws.token_ids[:lay.num_rows])
        if lay.bucket is not None:
            entry = self.graphs.entry(lay.bucket)
            self.graphs.run(entry, seqs)
            return entry.strategy, entry.fell_back
        if self.graphs:
            self.graphs.stats.unbucketed += 1
        meta = BatchMeta.build(seqs, ws.kv.page_size, self.model.device,
                               cascade=uses_cascade(self.model))
        program = model_program(self.model, ws, meta, lay.segments)
        strategy, fell_back = pick_strategy(self.strategy, self.fallback, program, num_decode)
        run_program(program, strategy, self.backend, self.stream_configs)
        return strategy, fell_back

    def follow(self, chunks: list[tuple[int, int, bool]], samples: list[bool]) -> None:
        """A tensor-parallel worker's step: plan rank 0's batch (its journaled KV changes
        replayed), run the same forward and LM head (whose all-gather every rank joins)."""
        seqs = self.scheduler.plan(chunks)
        lay = self.lay_out(seqs, samples)
        self.forward(seqs, lay, sum(c.is_decode for c in seqs))
        if lay.rows:
            self.model.logits(self.ws, host_to_device(lay.rows, torch.int64, self.model.device))

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
        self.scheduler.launched(batch)
        self._pending_row.update((r.request_id, i) for i, r in enumerate(samplers))
        self.stats.count_batch(batch.num_tokens, batch.num_prefill)
        return _Launched(samplers, tokens, *to_host(marked))

    def gpu_timeline_report(self) -> dict[str, float] | None:
        """With `gpu_timeline`: runtime/stats.py `timeline_report` of this engine's stats."""
        return timeline_report(self.stats)

    def forward_ms_by_shape(self) -> dict[tuple[int, int], list[float]]:
        """With `gpu_timeline`: runtime/stats.py `forward_ms_by_shape` of this engine's stats."""
        return forward_ms_by_shape(self.stats)

    # ---- post-process ----------------------------------------------------------------------
    def _post_process(self, launched: _Launched) -> list[Request]:
        if launched.ready is not None:
            launched.ready.synchronize()
        ended = self.scheduler.update_from_output(launched.samplers, launched.host.tolist(),
                                                self.clock() - self.t0, self.eos_ids,
                                                self.on_token)
        for r in ended:
            self._pending_row.pop(r.request_id, None)
        self.finished += ended
        return ended
