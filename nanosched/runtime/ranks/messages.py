"""What rank 0 sends the other ranks of a tensor-parallel engine (runtime/ranks/channel.py
carries them, pickled).

Per engine: `OpenEngine` (its resolved config and strategy, when rank 0 builds it), then per
iteration a `Step`, any number of `Call`s (work on every rank, e.g. a benchmark's timed
forward), and `CloseEngine`. `Stop` ends a worker. `Step` and `Call` carry the journal of KV
changes rank 0's scheduler made since the last message (runtime/kv_pool.py `replay_kv_ops`):
pages reserved and released, swaps out and in, host copies dropped. A `Step`'s batch is what
`KVCache.plan_chunks` takes, compacted: the request ids of its decode chunks (one token each,
each sampling) as an int64 array, then (request id, tokens, samples) per prompt chunk.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from nanosched.kernels.dispatch import KernelOptions
from nanosched.runtime.config import EngineConfig


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker loads at start (the model's shards of this rank)."""

    model: str
    weights: str  # "random" or a checkpoint folder
    seed: int
    kernels: KernelOptions
    device: str  # cpu | cuda (rank r on cuda:r)
    parent_pid: int  # rank 0's process: the worker ends when it is gone
    copy_engine: bool = False  # map the copy-engine all-reduce's buffers (as rank 0 does)
    quantization: str = "auto"  # the layer weights' (models/quant.py), resolved as rank 0 does
    dtype: str = "auto"  # --dtype (runtime/loader.py model_dtype)


@dataclass(frozen=True)
class OpenEngine:
    key: int
    config: EngineConfig  # resolved by rank 0 (dense batch, pages, context bound, graphs)
    strategy: str  # StrategyChoice.name: a name in strategies.NAMED | replay:<where>
    schedule: Any  # the schedule set a replay runs (None otherwise)


@dataclass(frozen=True)
class Step:
    key: int
    ops: list[tuple]
    decode_ids: array  # int64 request ids of the decode chunks
    prefill: list[tuple[int, int, bool]]  # (request id, tokens, samples) per prompt chunk

    def chunks(self) -> tuple[list[tuple[int, int, bool]], list[bool]]:
        """(chunks as `KVCache.plan_chunks` takes them, whether each samples)."""
        n = len(self.decode_ids)
        chunks = list(zip(self.decode_ids.tolist(), repeat(1, n), repeat(True, n), strict=True))
        chunks += [(r, k, False) for r, k, _ in self.prefill]
        return chunks, [True] * n + [s for _, _, s in self.prefill]


@dataclass(frozen=True)
class Call:
    key: int
    ops: list[tuple]
    fn: Callable[..., Any]  # fn(engine, *args), a module-level function (pickled by name)
    args: tuple


@dataclass(frozen=True)
class CloseEngine:
    key: int


@dataclass(frozen=True)
class Stop:
    pass


class EngineLink:
    """Rank 0's end of one engine on the other ranks: the journal its KV pool appends to, and
    the messages of its steps and calls."""

    def __init__(self, send: Callable[[Any], int], key: int) -> None:
        self.send, self.key = send, key
        self.journal: list[tuple] = []
        self.bytes_sent = 0
        self.steps = 0
        self.step_s = 0.0  # host time spent in `step` (building and posting the messages)

    def _take(self) -> list[tuple]:
        ops = list(self.journal)
        self.journal.clear()  # in place: the pool holds this list
        return ops

    def step(self, chunks: list[tuple[int, int, bool]], samples: list[bool],
             num_decode: int) -> None:
        """Send a batch (`chunks` as `KVCache.plan_chunks` takes them, decode chunks first;
        whether each samples) with the journal."""
        t0 = time.perf_counter()
        ids = array("q", [c[0] for c in chunks[:num_decode]])
        prefill = [(r, n, s) for (r, n, _), s in zip(chunks[num_decode:],
                                                    samples[num_decode:], strict=True)]
        self.bytes_sent += self.send(Step(self.key, self._take(), ids, prefill))
        self.steps += 1
        self.step_s += time.perf_counter() - t0

    def counters(self) -> tuple[int, float, int]:
        """(steps sent, host seconds spent sending them, bytes sent) so far."""
        return self.steps, self.step_s, self.bytes_sent

    def call(self, fn: Callable[..., Any], args: tuple) -> None:
        self.bytes_sent += self.send(Call(self.key, self._take(), fn, args))

    def close(self) -> None:
        self.send(CloseEngine(self.key))
