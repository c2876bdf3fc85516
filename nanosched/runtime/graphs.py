"""Forwards over CUDA-graph buckets: a batch laid out in a `Bucket`, replayed from a graph.

The engine asks the runner for a batch's bucket (models/bucket.py) and its entry, then runs the
batch (its `SeqChunk`s, decode first). Per bucket the runner keeps a `BucketMeta`, the forward's
`Program` over it, the strategy that runs it (what the engine's strategy `pick`s for the
bucket's shape: itself, one entry of a schedule set, or None, and then the fallback) and a
CUDA graph of that program run through the strategy on its streams (a multi-stream capture:
each stream forks from and joins to the capture stream, as in an eager forward). A bucket's
first batch runs eagerly, then its graph is captured and every later batch replays it.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nanosched.errors import ConfigError
from nanosched.models.batch import SeqChunk
from nanosched.models.bucket import Bucket, BucketMeta
from nanosched.models.cascade import uses_cascade
from nanosched.runtime.backend import Backend
from nanosched.runtime.config import GRAPH_MODES
from nanosched.runtime.modelprogram import model_program
from nanosched.runtime.opsched import OpScheduler, pick_strategy, run_program
from nanosched.runtime.program import LaunchConfig, Program


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager_bucket: int = 0  # bucketed batches run eagerly (first of a bucket, or no graph)
    unbucketed: int = 0  # batches no bucket holds
    capture_s: float = 0.0
    padded_rows: int = 0  # rows of padding run over all bucketed batches
    buckets: set[Bucket] = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        return {"captures": self.captures, "replays": self.replays,
                "eager_bucket": self.eager_bucket, "unbucketed": self.unbucketed,
                "capture_s": round(self.capture_s, 3), "padded_rows": self.padded_rows,
                "buckets": len(self.buckets)}


@dataclass
class _Entry:
    """A bucket's metadata, forward program, the strategy that runs it, and its graph (None
    until captured; stays None when the capture failed, with `error` saying why)."""

    meta: BucketMeta
    program: Program
    strategy: OpScheduler
    graph: Any = None
    error: str | None = None
    fell_back: bool = False  # the engine's strategy had nothing for this bucket


def check_graph_mode(mode: str, device: torch.device) -> None:
    """Refuse a graph mode an engine cannot run: not off, on or layout, or on without CUDA."""
    if mode not in GRAPH_MODES:
        raise ConfigError(f"graphs must be 'off', 'on' or 'layout', got {mode!r}")
    if mode == "on" and device.type != "cuda":
        raise ConfigError("CUDA graphs need a CUDA model; use graphs='layout' on the CPU")


def bucket_segments(bucket: Bucket) -> list[tuple[int, int, bool]]:
    """The segments a bucket's program declares: one per decode row, one prefill segment over
    every prefill row (so prefill attention depends on all earlier prefill K/V rows)."""
    segs = [(i, i + 1, True) for i in range(bucket.num_decode)]
    if bucket.num_tokens > bucket.num_decode:
        segs.append((bucket.num_decode, bucket.num_tokens, False))
    return segs


class BucketRunner:
    """Runs batches through what `strategy` picks for the bucket, or `fallback` when it picks
    nothing (decided once per bucket)."""

    def __init__(self, model: Any, ws: Any, backend: Backend, strategy: OpScheduler, *,
                 align: int, max_pages: int, capture: bool, fallback: OpScheduler | None = None,
                 stream_configs: dict[str, LaunchConfig] | None = None) -> None:
        self.model, self.ws, self.backend = model, ws, backend
        self.strategy, self.fallback = strategy, fallback or strategy
        self.align, self.max_pages = align, max_pages
        self.capture = capture and model.device.type == "cuda"
        self.stream_configs = stream_configs
        self.stats = GraphStats()
        self._entries: dict[Bucket, _Entry] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def errors(self) -> dict[tuple[str, Bucket], str]:
        """Why a bucket's capture failed, by (strategy name, bucket)."""
        return {(e.strategy.name, b): e.error for b, e in self._entries.items() if e.error}

    def release(self) -> None:
        """Drop every bucket's graph once the device has run them. A collective captured in a
        graph holds its communicator, and NCCL's teardown of the process group waits for what
        holds it, so an engine at tp > 1 releases its graphs before its ranks leave the group.
        Buckets met afterwards are laid out and captured afresh."""
        if self.capture and self._entries:
            torch.cuda.synchronize(self.model.device)
        self._entries.clear()

    def reset_stats(self) -> GraphStats:
        """Start counting afresh (the graphs stay); returns the new counters."""
        self.stats = GraphStats()
        return self.stats

    def bucket(self, seqs: Sequence[SeqChunk]) -> Bucket | None:
        return Bucket.for_chunks(seqs, page_size=self.ws.kv.page_size, align=self.align,
                                 max_tokens=self.ws.max_tokens, max_pages=self.max_pages)

    def entry(self, bucket: Bucket) -> _Entry:
        """The bucket's entry (made at its first batch, with the strategy that runs it)."""
        if bucket not in self._entries:
            kv = self.ws.kv
            meta = BucketMeta(bucket, kv.page_size, kv.scratch_slot, self.model.device,
                              cascade=uses_cascade(self.model))
            program = model_program(self.model, self.ws, meta, bucket_segments(bucket))
            strategy, fell_back = pick_strategy(self.strategy, self.fallback, program,
                                                bucket.num_decode)
            self._entries[bucket] = _Entry(meta, program, strategy, fell_back=fell_back)
        return self._entries[bucket]

    def run(self, entry: _Entry, seqs: Sequence[SeqChunk]) -> None:
        """Run the batch `seqs` laid out in `entry`'s bucket (token ids already written)."""
        b = entry.meta.bucket
        self.stats.buckets.add(b)
        self.stats.padded_rows += b.num_tokens - sum(c.num_tokens for c in seqs)
        entry.meta.write(seqs)
        if entry.graph is not None:
            entry.graph.replay()
            self.stats.replays += 1
            return
        run_program(entry.program, entry.strategy, self.backend, self.stream_configs)
        self.stats.eager_bucket += 1
        if self.capture and entry.error is None:
            t0 = time.perf_counter()
            try:
                entry.meta.freeze()
                entry.graph = self._capture(entry.program, entry.strategy)
                self.stats.captures += 1
            except Exception as exc:  # a strategy or kernel the graph cannot hold: stay eager
                entry.error = f"{type(exc).__name__}: {exc}"[:300]
            self.stats.capture_s += time.perf_counter() - t0

    def _capture(self, program: Program, strategy: OpScheduler) -> Any:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # thread_local: the NCCL watchdog thread may query events while this thread captures
        mode = "thread_local" if self.model.tp.size > 1 else "global"
        with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side, pool=self._pool,
                                                       capture_error_mode=mode):
            run_program(program, strategy, self.backend, self.stream_configs)
        torch.cuda.current_stream().wait_stream(side)
        return graph
