"""Shared helpers of the GPU benchmark scripts: environment record, timing, a copy ceiling,
green-context places, output, tables.

Each script writes one JSON file (device, versions, date, command, every number) to $OUT when
set, else bench/results/, and prints a short table last.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[1]  # the checkout: run scripts with PYTHONPATH=. there


def environment() -> dict[str, Any]:
    """Device name, SM count, memory, L2 size and software versions."""
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name, "num_sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]),
    }


def l2_bytes() -> int:
    """L2 cache size of GPU 0 (50 MiB if torch does not report it)."""
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 50 * 2**20


def median_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median time of `fn()` in ms through triton.testing.do_bench (warm-up first)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


GRAPH_CALLS = 20  # calls of a kernel per CUDA graph in `graph_us`


def graph_us(fn, calls: int = GRAPH_CALLS) -> float:
    """Median time of one call of `fn` in us, from replays of a CUDA graph of `calls` calls (a
    small kernel timed alone from Python costs more in launches than it runs)."""
    from nanosched.profiler.timing import captured

    g = captured(lambda: [fn() for _ in range(calls)], torch.cuda.Stream())
    return median_ms(g.replay, warmup_ms=50, rep_ms=200) * 1e3 / calls


def fastest(launches: dict[str, Callable[[], None]]) -> tuple[float, str, dict[str, Any]]:
    """Each launch run once (one that raises, as triton's OutOfResources for a tile that does
    not fit an SM, is recorded by its exception's name and skipped), then timed by `graph_us`:
    (the fastest's us, its name, every launch's us rounded to 0.01 or its exception's name)."""
    best, every = None, {}
    for name, run in launches.items():
        try:
            run()
        except Exception as err:  # noqa: BLE001 - triton's OutOfResources and kin
            every[name] = type(err).__name__
            continue
        us = graph_us(run)
        every[name] = round(us, 2)
        if best is None or us < best[0]:
            best = (us, name)
    if best is None:
        raise RuntimeError(f"no launch ran: {every}")
    return best[0], best[1], every


def copy_bandwidth_gbs(nbytes: int = 2**32) -> float:
    """Device-to-device copy of `nbytes` on the current stream: (read + write) bytes / time."""
    bufs = [torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")]
    bufs.append(torch.empty_like(bufs[0]))
    ms = median_ms(lambda: bufs[1].copy_(bufs[0]))
    bufs.clear()
    torch.cuda.empty_cache()
    return 2 * nbytes / ms / 1e6


def places(sms_list: list[int]) -> list[tuple[int, Any, Any]]:
    """(granted SMs, stream, partition pair) for a green-context partition of about each of
    `sms_list` SMs (the driver rounds to its granularity), then (all SMs, the current stream,
    None) for the whole GPU. Close each pair when done."""
    from nanosched.greenctx import split_sms

    out = []
    for small in sms_list:
        pair = split_sms(0, small)
        out.append((pair.small.sms, pair.small.stream, pair))
    n = torch.cuda.get_device_properties(0).multi_processor_count
    out.append((n, torch.cuda.current_stream(), None))
    return out


class KeyBatch(NamedTuple):
    """One batch laid out as `nanosched verify` lays out a key, ready for Sequential."""

    runner: Any  # runtime.graphs.BucketRunner
    entry: Any  # its bucket entry (its CUDA graph once run, with capture)
    seqs: Any  # the batch's SeqChunks
    ws: Any  # the workspace it is planned into
    context: int  # the decode rows' cached context (what fits the cache)


def key_batch(model: Any, rows: int, decode: int, context: int, prompt: int, *,
              capture: bool, random_cache: bool = True) -> KeyBatch:
    """`decode` decode rows with `context` cached tokens each, then prompt chunks of at most
    `prompt` tokens filling `rows` (`benchmarks.common.bucket_batch`), in a workspace of their
    own, on a Sequential `BucketRunner` (`capture`: a CUDA graph on the first run). The cache
    holds random K/V as `verify` fills it, or zeros (`random_cache=False`)."""
    from nanosched.benchmarks.common import bucket_batch, synthetic_decode_context
    from nanosched.benchmarks.throughput import forward_pages
    from nanosched.constants import PAGE_SIZE
    from nanosched.runtime.backend import Backend
    from nanosched.runtime.config import EngineConfig
    from nanosched.runtime.device import CudaDevice
    from nanosched.runtime.graphs import BucketRunner
    from nanosched.runtime.strategies import Sequential

    ws = model.new_workspace(rows, num_pages=forward_pages(rows, decode, context, prompt,
                                                           PAGE_SIZE))
    if random_cache:
        ws.kv.fill_random(torch.Generator(model.device).manual_seed(0))
    ctx = synthetic_decode_context(ws, rows, decode, context, prompt)
    seqs, _ = bucket_batch(ws, rows, decode, ctx, prompt, 10**8, EngineConfig.graph_align)
    runner = BucketRunner(model, ws, Backend(CudaDevice()), Sequential(),
                          align=EngineConfig.graph_align,
                          max_pages=-(-max(ctx + 1, prompt) // PAGE_SIZE), capture=capture)
    return KeyBatch(runner, runner.entry(runner.bucket(seqs)), seqs, ws, ctx)


class BatchMix(NamedTuple):
    """An engine batch as the rows price it."""

    num_decode: int
    decode_context: float  # the decode rows' mean context (their cached tokens and the new one)
    prompt_rows: int
    prompt_end: int  # the longest prompt chunk's end (what prefill attention is keyed by)


def batch_mix(batch: Any) -> BatchMix:
    """The decode rows, their mean context, the prompt rows and the longest prompt chunk's end
    of a `runtime.request_scheduler.Batch`."""
    dec = [e for e in batch.entries if e.is_decode]
    pre = [e for e in batch.entries if not e.is_decode]
    return BatchMix(len(dec), statistics.fmean(e.start + 1 for e in dec) if dec else 0.0,
                    sum(e.num_tokens for e in pre),
                    max((e.start + e.num_tokens for e in pre), default=0))


def row_us(prof: Any, op: str, rows: int, context: float | None) -> float:
    """`op` over `rows` rows: the profile's rows linear between its 128-row grid points (the
    smallest point for fewer rows: a GEMM then costs its weights' read)."""
    from nanosched.constants import TOKEN_QUANTUM

    lo = max(TOKEN_QUANTUM, rows // TOKEN_QUANTUM * TOKEN_QUANTUM)
    hi = max(TOKEN_QUANTUM, -(-rows // TOKEN_QUANTUM) * TOKEN_QUANTUM)
    a = prof.kernel_time_us(op, lo, None, context)
    if hi == lo:
        return a
    return a + (prof.kernel_time_us(op, hi, None, context) - a) * (rows - lo) / (hi - lo)


def context_clamp(prof: Any) -> Callable[[str, float | None], float | None]:
    """A function of (op, context) giving an attention context within the contexts `prof`
    measured for that op (the nearest end outside them); others unchanged. A quick profile
    holds prefill at the workload's prompt length only, so a chunk ending earlier is priced
    at that length (over its row; prefill attention is a few percent of a layer), where
    `row_us` would refuse it. The ranges are read from the rows once."""
    contexts: dict[str, set[float]] = {}
    for r in prof.kernels:
        contexts.setdefault(r.op, set()).add(r.context)
    ranges = {op: (min(c), max(c)) for op, c in contexts.items() if c != {0}}

    def clamp(op: str, context: float | None) -> float | None:
        if context is None or op not in ranges:
            return context
        lo, hi = ranges[op]
        return min(max(context, lo), hi)
    return clamp


def results_dir() -> Path:
    """Where a benchmark writes its JSON: $OUT when set (the GPU machine's), else
    bench/results/."""
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def write_result(name: str, data: dict[str, Any]) -> Path:
    """Write data as JSON to `results_dir()`, named after the script, device and time."""
    out_dir = results_dir()
    env = data["env"]
    stamp = env["date"].replace(":", "").replace("-", "")[:15]
    device = env["device"].replace(" ", "_")
    path = out_dir / f"{name}-{device}-{stamp}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def print_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    """Aligned text table; columns are (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([format(row[k], f) if f and isinstance(row[k], (int, float)) else
                      str(row[k]) for k, _, f in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for n, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if n == 0:
            print("  ".join("-" * w for w in widths))
