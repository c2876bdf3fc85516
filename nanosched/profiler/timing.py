"""CUDA-event timing of one kernel alone and of two kernels co-running (GPU-only).

`bench_us(fn)`: warm-up, then as many launches as fit `rep_ms` (5..`max_iters`), each between
two events with the L2 cache flushed before it; the median, in us. The timed launches are queued
behind a `torch.cuda._sleep` long enough for the CPU to queue all of them first, so an op that
launches several kernels from Python (prefill attention: a few per prompt) is timed by its GPU
work, not by the CPU's launch gaps between its kernels (a CUDA graph or a runtime that runs
ahead of the GPU has none).

`co_run_us(a, b)`: both streams are held behind a `torch.cuda._sleep` on the launching stream
while every launch is queued (so the CPU never starves a stream), then released together; the
sleep covers twice what the warm-up launches cost the CPU (a Python-launched NCCL collective
costs tens of us). Each
stream loops its kernel enough times to cover `window_ms` and records an event after every
launch. Only launches that start and end while both streams are busy count: their median span is
each kernel's co-run time. This times each kernel's own span, not the pair's makespan.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

L2_FLUSH_BYTES = 128 << 20  # over twice the L2 of an H100/H200 (50 MB)
SLEEP_CYCLES_PER_US = 2_000  # an H100/H200 SM clock is at most about 2 GHz
MAX_SLEEP_US = 200_000.0

_flush: dict[str, torch.Tensor] = {}


def _flush_buffer(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _flush:
        _flush[key] = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    return _flush[key]


def bench_us(fn: Callable[[], Any], device: torch.device, rep_ms: float = 10.0,
             warmup: int = 3, max_iters: int = 200, flush: bool = True) -> float:
    """Median time of `fn` on the current stream, in microseconds."""
    stream = torch.cuda.current_stream(device)
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    cpu_us = launch_cpu_us(fn)
    end.record(stream)
    end.synchronize()
    estimate_ms = max(start.elapsed_time(end), 1e-3)
    n = int(min(max_iters, max(5, rep_ms / estimate_ms)))
    buf = _flush_buffer(device) if flush else None
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
    torch.cuda._sleep(queue_cycles(n * (cpu_us + 20)))  # the 20 us: each flush
    for a, b in events:
        if buf is not None:
            buf.zero_()
        a.record(stream)
        fn()
        b.record(stream)
    events[-1][1].synchronize()
    return 1e3 * statistics.median(a.elapsed_time(b) for a, b in events)


def launch_cpu_us(fn: Callable[[], Any]) -> float:
    """What one call of `fn` costs the CPU, in us (its GPU work is not waited for)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def queue_cycles(cpu_us: float) -> int:
    """Sleep cycles that hold the GPU while the CPU queues launches costing `cpu_us` in all
    (twice that, bounded by MAX_SLEEP_US)."""
    return int(SLEEP_CYCLES_PER_US * min(MAX_SLEEP_US, max(2 * cpu_us, 20.0)))


def co_run_us(fn_a: Callable[[], Any], stream_a: Any, alone_a_us: float,
              fn_b: Callable[[], Any], stream_b: Any, alone_b_us: float,
              device: torch.device, window_ms: float = 3.0,
              max_launches: int = 400) -> tuple[float, float]:
    """(a, b): median time of each kernel while the other runs beside it, in us."""
    n_a = int(min(max_launches, max(4, math.ceil(1e3 * window_ms / alone_a_us))))
    n_b = int(min(max_launches, max(4, math.ceil(1e3 * window_ms / alone_b_us))))
    fn_a(), fn_b()  # warm (compiles, allocator)
    torch.cuda.synchronize(device)
    cpu_a, cpu_b = launch_cpu_us(fn_a), launch_cpu_us(fn_b)
    torch.cuda.synchronize(device)
    main = torch.cuda.current_stream(device)
    start = torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(queue_cycles(n_a * (cpu_a + 20) + n_b * (cpu_b + 20)))
    start.record(main)
    ev_a = [torch.cuda.Event(enable_timing=True) for _ in range(n_a + 1)]
    ev_b = [torch.cuda.Event(enable_timing=True) for _ in range(n_b + 1)]
    for stream, ev in ((stream_a, ev_a), (stream_b, ev_b)):
        stream.wait_event(start)
        ev[0].record(stream)
    for i in range(max(n_a, n_b)):
        for stream, ev, fn, n in ((stream_a, ev_a, fn_a, n_a), (stream_b, ev_b, fn_b, n_b)):
            if i < n:
                with torch.cuda.stream(stream):
                    fn()
                ev[i + 1].record(stream)
    torch.cuda.synchronize(device)
    t_a = [start.elapsed_time(e) for e in ev_a]
    t_b = [start.elapsed_time(e) for e in ev_b]
    lo, hi = max(t_a[0], t_b[0]), min(t_a[-1], t_b[-1])
    return 1e3 * _inside(t_a, lo, hi), 1e3 * _inside(t_b, lo, hi)


def _inside(times: list[float], lo: float, hi: float) -> float:
    """Median span of launches within [lo, hi]; the mean over all when too few lie inside."""
    spans = [b - a for a, b in zip(times, times[1:], strict=False) if a >= lo and b <= hi]
    if len(spans) >= 3:
        return statistics.median(spans)
    return (times[-1] - times[0]) / (len(times) - 1)
