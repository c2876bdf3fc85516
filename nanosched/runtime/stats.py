"""What an engine counts and times: `EngineStats`, and the reports read from its GPU marks.

`timeline_report` and `forward_ms_by_shape` read the CUDA events an engine with `gpu_timeline`
records around each iteration and each forward (runtime/engine.py); `ForwardTimer` times one
forward for `time_forwards`.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch

from nanosched.runtime.graphs import GraphStats


@dataclass
class EngineStats:
    iterations: int = 0
    tokens: int = 0  # prompt + decode tokens processed
    prefill_tokens: int = 0  # of which prompt (prefill) tokens
    fallbacks: int = 0  # iterations the strategy had nothing for (its fallback ran them)
    pipelined: int = 0  # iterations a pipelining strategy ran (a replay, two-batch overlap)
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

    def count_forward(self, shape: tuple[int, int], strategy: Any, fell_back: bool,
                      marks: tuple[Any, Any] | None = None) -> None:
        """A forward run at `shape` (decode rows, rows) by `strategy`, the fallback or not;
        with `marks` (gpu_timeline) the CUDA events around it."""
        self.shapes[shape] += 1
        if marks is not None:
            self.forward_marks.append((shape, *marks))
        self.fallbacks += fell_back
        if not fell_back:
            self.pipelined += strategy.pipelined
            self.sequential += not strategy.pipelined

    def count_batch(self, num_tokens: int, num_prefill: int) -> None:
        """An iteration of `num_tokens` tokens, `num_prefill` of them prompt tokens."""
        self.iterations += 1
        self.tokens += num_tokens
        self.prefill_tokens += num_prefill
        self.batch_sizes.append(num_tokens)


def busy_and_idle(spans: list[tuple[float, float]]) -> tuple[float, float]:
    """(busy, idle) of a stream over iterations whose work ran from start to end (in order, one
    clock): busy the sum of the spans, idle the gaps between an end and the next start, when
    the GPU had finished one iteration and the CPU had not yet queued the next."""
    busy = sum(end - start for start, end in spans)
    idle = sum(max(0.0, nxt - end) for (_, end), (nxt, _) in pairwise(spans))
    return busy, idle


def timeline_report(stats: EngineStats) -> dict[str, float] | None:
    """The iterations recorded since the stats were last reset, the seconds the GPU spent on
    their work, and the seconds it sat between them waiting for the CPU (waits for the last
    iteration's end). None without a record."""
    marks = stats.gpu_marks
    if not marks:
        return None
    marks[-1][1].synchronize()
    t0 = marks[0][0]
    busy, idle = busy_and_idle([(t0.elapsed_time(s), t0.elapsed_time(e)) for s, e in marks])
    return {"iterations": len(marks), "busy_s": busy / 1e3, "idle_s": idle / 1e3}


def forward_ms_by_shape(stats: EngineStats) -> dict[tuple[int, int], list[float]]:
    """The GPU time (ms) of each forward recorded since the stats were last reset, by the
    (D rows, T rows) shape it ran at (its graph bucket's, else its batch's): the metadata
    writes and the layers, as a schedule set prices a bucket (no LM head or sampling). Empty
    without a record."""
    out: dict[tuple[int, int], list[float]] = {}
    if stats.forward_marks:
        stats.forward_marks[-1][2].synchronize()
    for shape, start, end in stats.forward_marks:
        out.setdefault(shape, []).append(start.elapsed_time(end))
    return out


class ForwardTimer:
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
