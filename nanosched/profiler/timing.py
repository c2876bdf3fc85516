"""CUDA-event timing of one kernel alone and of two kernels co-running (GPU-only).

`bench_us(fn)`: warm-up, then as many launches as fit `rep_ms` (5..`max_iters`), each between
two events with the L2 cache flushed before it; the median, in us. The flush reads a buffer
twice the L2's size, which leaves the L2 cold and clean: a flush by writing left it full of
dirty lines that the timed kernel then wrote back as it evicted them, which made an RMSNorm at
1,024 rows 16.4 us against 14.1 (read flush) and 10.5 (none; `bench/hardware/row_flush.py`); GEMMs
take the same time either way. The timed launches are queued
behind a `torch.cuda._sleep` long enough for the CPU to queue all of them first, so an op that
launches several kernels from Python (prefill attention: a few per prompt) is timed by its GPU
work, not by the CPU's launch gaps between its kernels (a CUDA graph or a runtime that runs
ahead of the GPU has none).

More in docs/profiler.md, module notes.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

L2_FLUSH_BYTES = 128 << 20  # over twice the L2 of an H100/H200 (50 MB)
SLEEP_CYCLES_PER_US = 2_000  # an H100/H200 SM clock is at most about 2 GHz
MAX_SLEEP_US = 200_000.0
MIN_SPAN_US = 100.0  # sustained_run: GPU work between two events of one stream, at least

FLUSH_CPU_US = 20.0  # what launching one flush costs the CPU, about

_flush: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (buffer, its sum)


def _flush_buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = str(device)
    if key not in _flush:
        _flush[key] = (torch.zeros(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device),
                       torch.empty((), dtype=torch.int64, device=device))
    return _flush[key]


def _flush_buffer(device: torch.device) -> torch.Tensor:
    """The buffer `flush_l2` reads (bench/hardware/row_flush.py also writes it)."""
    return _flush_buffers(device)[0]


def flush_l2(device: torch.device) -> None:
    """Evict the L2 by reading a buffer twice its size (it is left cold and clean)."""
    buf, total = _flush_buffers(device)
    torch.sum(buf, 0, out=total)


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
    if flush:  # allocated before the launches are queued behind the sleep
        _flush_buffers(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
    torch.cuda._sleep(queue_cycles(n * (cpu_us + (FLUSH_CPU_US if flush else 0.0))))
    for a, b in events:
        if flush:
            flush_l2(device)
        a.record(stream)
        fn()
        b.record(stream)
    events[-1][1].synchronize()
    return 1e3 * statistics.median(a.elapsed_time(b) for a, b in events)


def gemm_peak_tflops(device: torch.device, precision: str = "bf16") -> float:
    """GEMM TFLOP/s at 8192^3: the median of 50 ms of launches, started from an idle GPU; bf16
    (`torch.mm`) or fp8 (e4m3 operands with row scales, bf16 out: the model's FP8 GEMM,
    kernels/dispatch.linear_fp8).

    This is the peak with the SM clock at its maximum. A longer window reads less (a GEMM loop
    draws the board to its power cap within a few hundred ms and the clock falls: 686-757
    TFLOP/s over 200 ms on one H100, 791-798 over 50 ms), and how far it falls depends on what
    the GPU ran just before; the short window reads the same in every run, so a throughput
    measured against it (the benchmark's % of optimal) is comparable across runs and with the
    profile's ceiling."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    fn = lambda: a @ b  # noqa: E731
    if precision == "fp8":
        from nanosched.kernels.dispatch import KernelOptions, linear_fp8
        from nanosched.kernels.reference import quantize_fp8

        (a8, sa), (b8, sb) = quantize_fp8(a), quantize_fp8(b)
        out = torch.empty_like(a)
        opts = KernelOptions()
        fn = lambda: linear_fp8(a8, sa, b8, sb, None, out, opts)  # noqa: E731
    torch.cuda.synchronize(device)
    time.sleep(0.2)  # whatever ran before has let the clock back up
    t = bench_us(fn, device, rep_ms=50, flush=False)
    return 2 * 8192 ** 3 / t / 1e6


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


@dataclass
class Sustained:
    """Kernels looped back to back on their streams for `settle_s` + a measuring window.

    Per stream: `median_us` of the launches inside the window (after the settle time, while
    every stream is still busy), and `series` (GPU start ms from the first launch, span us) of
    every launch; `window_ms` the window on the GPU clock; `host_window` the same on the host's
    perf_counter clock, for telemetry."""

    median_us: list[float]
    series: list[list[tuple[float, float]]]
    window_ms: tuple[float, float]
    host_window: tuple[float, float]


def sustained_run(work: list[tuple[Callable[[], Any], Any, float]], device: torch.device,
                  settle_s: float, window_s: float, queue_ms: float = 20.0) -> Sustained:
    """Loop each (fn, stream, alone_us) of `work` on its stream for settle_s + window_s.

    A kernel shorter than MIN_SPAN_US is called several times between two events (its time is
    the span over the calls), so the events and the launch loop cost the CPU less than the GPU
    work they time. The CPU keeps each stream about `queue_ms` of work ahead of the GPU (it
    tops up every stream's queue in turn and never waits on one stream while another runs
    dry), so host and GPU clocks stay within a queue of each other and every stream stays fed
    for the whole run, however much the co-run slows it.
    """
    for fn, stream, _ in work:
        with torch.cuda.stream(stream):
            fn()  # warm (compiles, allocator)
    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)
    start.record(torch.cuda.current_stream(device))
    host_t0 = time.perf_counter()
    reps = [max(1, math.ceil(MIN_SPAN_US / max(us, 1.0))) for _, _, us in work]
    depth = [max(2, math.ceil(1e3 * queue_ms / (r * max(us, 1.0))))
             for r, (_, _, us) in zip(reps, work, strict=True)]
    events: list[list[Any]] = [[] for _ in work]
    pending: list[list[Any]] = [[] for _ in work]
    for (_, stream, _), ev in zip(work, events, strict=True):
        stream.wait_event(start)
        ev.append(torch.cuda.Event(enable_timing=True))
        ev[0].record(stream)
    deadline = host_t0 + settle_s + window_s
    while time.perf_counter() < deadline:
        launched = False
        for i, (fn, stream, _) in enumerate(work):
            while pending[i] and pending[i][0].query():
                pending[i].pop(0)
            while len(pending[i]) < depth[i]:  # top up this stream without waiting on it
                with torch.cuda.stream(stream):
                    for _ in range(reps[i]):
                        fn()
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                events[i].append(end)
                pending[i].append(end)
                launched = True
        if not launched:
            time.sleep(5e-5)
    torch.cuda.synchronize(device)
    times = [[start.elapsed_time(e) for e in ev] for ev in events]
    lo = max(t[0] for t in times) + 1e3 * settle_s
    hi = min(t[-1] for t in times)
    series = [[(a, 1e3 * (b - a) / r) for a, b in zip(t, t[1:], strict=False)]
              for r, t in zip(reps, times, strict=True)]
    medians = [1e3 * _inside(t, lo, hi) / r for r, t in zip(reps, times, strict=True)]
    return Sustained(medians, series, (lo, hi), (host_t0 + lo / 1e3, host_t0 + hi / 1e3))


@dataclass
class SustainedSequence:
    """A sequence looped on one stream for settle_s + window_s: each function's median span
    over the passes inside the window, how many passes that was, how many times the GPU had
    run out of queued work (`starved`: the CPU launched slower than the GPU ran), and the
    window on the host's clock, for telemetry."""

    median_us: list[float]
    passes: int
    starved: int
    host_window: tuple[float, float]


def sustained_sequence(fns: list[Callable[[], Any]], device: torch.device, settle_s: float,
                       window_s: float, queue_ms: float = 20.0) -> SustainedSequence:
    """Call `fns` in order on the current stream, pass after pass, for settle_s + window_s,
    keeping about `queue_ms` of passes queued ahead of the GPU; an event after every call."""
    stream = torch.cuda.current_stream(device)
    for fn in fns:
        fn()  # warm (compiles, allocator)
    torch.cuda.synchronize(device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    for fn in fns:
        fn()
    b.record(stream)
    b.synchronize()
    depth = max(2, math.ceil(queue_ms / max(a.elapsed_time(b), 1e-3)))
    start = torch.cuda.Event(enable_timing=True)
    start.record(stream)
    host_t0 = time.perf_counter()
    events: list[Any] = [start]
    pending: list[Any] = []  # each queued pass's last event
    starved_at: list[float] = []  # host seconds when the queue was found empty
    deadline = host_t0 + settle_s + window_s
    while time.perf_counter() < deadline:
        while pending and pending[0].query():
            pending.pop(0)
        if not pending and len(events) > 1:
            starved_at.append(time.perf_counter() - host_t0)
        if len(pending) < depth:
            for fn in fns:
                fn()
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(stream)
                events.append(ev)
            pending.append(events[-1])
        else:
            time.sleep(5e-5)
    torch.cuda.synchronize(device)
    times = [start.elapsed_time(e) for e in events]
    n = len(fns)
    lo, hi = 1e3 * settle_s, times[-1]
    passes = [times[i * n:(i + 1) * n + 1] for i in range((len(times) - 1) // n)]
    inside = [p for p in passes if p[0] >= lo and p[-1] <= hi]
    if len(inside) < 3:
        inside = passes
    medians = [1e3 * statistics.median(p[i + 1] - p[i] for p in inside) for i in range(n)]
    starved = sum(1 for t in starved_at if t >= settle_s)
    return SustainedSequence(medians, len(inside), starved,
                             (host_t0 + lo / 1e3, host_t0 + hi / 1e3))


def captured(fn: Callable[[], Any], stream: Any) -> Any:
    """`fn` captured in a CUDA graph on `stream` after one eager warm-up call (the
    collectives' pairs replay it: one launch, however many kernels and copies it holds). The
    warm-up call runs after the work already queued on the current stream (its inputs)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        fn()
    return graph


@dataclass
class FixedRun:
    """`sustained_fixed`'s result: each side's median span inside the window where both ran
    (after the settle time), in us (None: too few launches there), and that window on the
    host's clock, for telemetry."""

    loop_us: float | None
    fixed_us: float | None
    host_window: tuple[float, float]


def sustained_fixed(loop: Callable[[], Any] | None, loop_stream: Any, fixed: Callable[[], Any],
                    fixed_stream: Any, n: int, settle_s: float, depth: int = 4) -> FixedRun:
    """Launch `fixed` exactly `n` times on its stream while `loop` (None: nothing) is launched
    on its own for as long as the `fixed` launches last; each stream keeps at most `depth`
    launches queued and is topped up by polling, so neither waits on the other's queue (a host
    loop that launched them in a fixed ratio would time itself). A collective's ranks pass the
    same `n`, so its launches pair up; `loop` needs no partner."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)
    start.record(torch.cuda.current_stream(device))
    jobs = [(fixed, fixed_stream)] + ([(loop, loop_stream)] if loop is not None else [])
    events: list[list[Any]] = [[] for _ in jobs]
    for _, stream in jobs:
        stream.wait_event(start)
    host_t0 = time.perf_counter()
    while len(events[0]) < n:
        launched = False
        for (fn, stream), evs in zip(jobs, events, strict=True):
            if len(evs) < depth or evs[-depth].query():
                with torch.cuda.stream(stream):
                    fn()
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                evs.append(end)
                launched = True
            if len(events[0]) >= n:
                break
        if not launched:
            time.sleep(5e-5)
    events[0][-1].synchronize()
    host_t1 = time.perf_counter()
    torch.cuda.synchronize(device)
    times = [[start.elapsed_time(e) for e in evs] for evs in events]
    lo, hi = 1e3 * settle_s, min(t[-1] for t in times)
    spans = []
    for t in times:
        inside = [x for x in t if lo <= x <= hi]
        spans.append(1e3 * statistics.median(b - a for a, b in zip(inside, inside[1:],
                                                                   strict=False))
                     if len(inside) >= 3 else None)
    return FixedRun(spans[1] if loop is not None else None, spans[0],
                    (host_t0 + settle_s, host_t1))
