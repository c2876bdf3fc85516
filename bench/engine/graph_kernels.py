"""GPU time of each op inside a Sequential forward's CUDA graph, against the op launched alone.

    PYTHONPATH=. python bench/engine/graph_kernels.py [--decode 256] [--tokens 1024]
        [--context 1280]
        [--prompt 1024] [--settle 1.0] [--forwards 5] [--alone-settle 1.0]

Llama-3-8B, random bf16 weights, one batch of `--decode` decode rows (each with `--context`
cached tokens) and prompt chunks filling `--tokens` rows, laid out as `nanosched verify` lays
out a key (`benchmarks.common.bucket_batch`; the cache filled with random K/V, as `verify`
fills it), run by Sequential and captured as a CUDA graph.
The graph is replayed back to back for `--settle` seconds (the clock settles under the power
cap), then `--forwards` replays are traced one by one by CUPTI (torch.profiler). Each forward's
kernels are attributed to the layer's ops (`kernel_trace`: GEMMs by their order,
the rest by name); per op, the median over layers and forwards of its GPU time per layer.

Then every op at the same shape, built as the profiler builds its kernel row (the implementation
the graph runs: cuBLAS GEMMs, the Triton kernels, the default decode attention), launched alone:
- `row`: `profiler.timing.bench_us`, as the profile's rows are timed (L2 flushed before each
  launch, 10 ms of launches);
- `burst`: 20 launches back to back, no flush, traced by CUPTI (kernel time and name);
- `sustained`: the same after `--alone-settle` seconds of looping the op (the clock under the
  cap, as a GEMM-only stream would keep it);
- `graph`: 20 launches captured in a CUDA graph of their own, replayed and traced (whether
  capture changes what cuBLAS launches).
SM clock and board power (NVML) beside each. The table says, per op, the profile's row, each of
these, the time inside the forward, and whether the forward ran the kernel the row timed: what
makes Sequential run ~10% under the sum of its rows (docs/findings.md, 'What the kernel rows
price') shows as the column that moves. GPU only; JSON to $OUT or bench/results/; table last.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from bench._common import environment, key_batch, print_table, write_result
from bench.engine.kernel_trace import attribute, cuda_kernels
from nanosched.autosearch.durations import op_context
from nanosched.autosearch.simulate import sequential_op_times
from nanosched.kernels.impls import DEFAULT_DECODE
from nanosched.models.ops import layer_ops
from nanosched.models.spec import load_spec
from nanosched.profiler import impl_registry, timing
from nanosched.profiler.catalog import load_named_profile
from nanosched.profiler.impl_registry import OpCall, ScratchSpace
from nanosched.profiler.telemetry import open_telemetry
from nanosched.runtime.loader import load_model
from nanosched.schedules.format import BatchInfo

IMPL = {"kqv": "cublas", "o": "cublas", "ug": "cublas", "d": "cublas",
        "attn_decode": DEFAULT_DECODE}  # every other op: "triton"
LAUNCHES = 20


def shape_of(op: str, decode: int, tokens: int, context: float, prompt: int) -> tuple[int, int]:
    """(rows, context) of `op` in this batch, as the search keys the profile's rows."""
    if op == "attn_decode":
        return decode, op_context("attn_decode", context, prompt)
    if op == "attn_prefill":
        return tokens - decode, op_context("attn_prefill", context, prompt)
    return tokens, 0


def clock(tele: Any, t0: float, t1: float) -> dict[str, Any] | None:
    r = tele.reading(t0, t1) if tele is not None else None
    return r.to_json() if r is not None else None


def traced(fn, launches: int = LAUNCHES) -> tuple[float, list[str]]:
    """Median CUPTI kernel time per call of `fn` (us) and the kernel names it ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(launches):
            fn()
        torch.cuda.synchronize()
    ks = cuda_kernels(prof)
    per_call = sum(k.duration_us for k in ks) / launches
    return per_call, sorted({k.name for k in ks})


def alone(op: str, spec: Any, rows: int, ctx: int, max_tokens: int, dev: torch.device,
          tele: Any, sustain_s: float) -> dict[str, Any]:
    """The op launched alone at this shape: the row's timing, a burst, sustained, in a graph."""
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ws = ScratchSpace(dev)
    call = OpCall(spec, 1, op, rows, ctx, num_sms, "full", num_sms, ws, max_tokens)
    kernel = impl_registry.get(op, IMPL.get(op, "triton")).kernel(call)
    out: dict[str, Any] = {"op": op, "rows": rows, "context": ctx,
                           "impl": IMPL.get(op, "triton")}
    with kernel.scope():
        kernel.fn()
        torch.cuda.synchronize()
        time.sleep(0.1)  # idle: the burst starts at the clock a layer's short ops see
        t0 = time.perf_counter()
        out["row_us"] = timing.bench_us(kernel.fn, dev)
        out["burst_us"], out["burst_kernels"] = traced(kernel.fn)
        out["burst_clock"] = clock(tele, t0, time.perf_counter())
        end = time.perf_counter() + sustain_s
        while time.perf_counter() < end:
            for _ in range(10):
                kernel.fn()
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out["sustained_us"], _ = traced(kernel.fn)
        out["sustained_clock"] = clock(tele, t0 - 0.05, time.perf_counter())
        try:
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                kernel.fn()  # warm the capture stream's handles (cuBLAS workspace) first
                side.synchronize()
                with torch.cuda.graph(graph, stream=side):
                    for _ in range(LAUNCHES):
                        kernel.fn()
            graph.replay()
            torch.cuda.synchronize()
            us, out["graph_kernels"] = traced(graph.replay, 1)
            out["graph_us"] = us / LAUNCHES
        except Exception as exc:  # noqa: BLE001 - a setup that cannot be captured: say so
            out["graph_us"], out["graph_error"] = float("nan"), f"{type(exc).__name__}: {exc}"
    ws.clear()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--context", type=int, default=1280)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--forwards", type=int, default=5)
    ap.add_argument("--alone-settle", type=float, default=1.0)
    args = ap.parse_args()
    spec = load_spec("llama3-8b")
    dev = torch.device("cuda", 0)
    tele = open_telemetry(0)
    model = load_model(spec, "random", dev)
    runner, entry, seqs, ws, ctx = key_batch(model, args.tokens, args.decode, args.context,
                                             args.prompt, capture=True)
    runner.run(entry, seqs)  # eager first (compiles), then captured
    graph = entry.graph
    assert graph is not None, "no CUDA graph was captured"
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.settle:
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(args.forwards):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    forward_clock = clock(tele, t0, time.perf_counter())
    wall_us = start.elapsed_time(end) * 1e3 / args.forwards
    layers = spec.num_layers
    per_op: dict[str, list[float]] = defaultdict(list)
    names: dict[str, set[str]] = defaultdict(set)
    per_name: dict[str, float] = defaultdict(float)
    failures = []
    for _ in range(args.forwards):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        kernels = cuda_kernels(prof)
        for k in kernels:
            per_name[k.name] += k.duration_us
        att = attribute(kernels, layers)
        if isinstance(att, str):
            failures.append(att)
            continue
        for layer in att.per_layer:
            for op, us in layer.items():
                per_op[op].append(us)
        for op, ns in att.names.items():
            names[op].update(ns)
    in_forward = {op: statistics.median(v) for op, v in per_op.items()}
    kernel_sum = sum(per_name.values()) / args.forwards / layers
    del graph, entry, runner, ws, model
    torch.cuda.empty_cache()

    # the shipped H100 profile's row of each op at this batch, as the search prices Sequential
    profile_rows = sequential_op_times(
        spec, 1, load_named_profile("llama3-8b-tp1-h100"),
        BatchInfo(args.tokens, args.decode, args.prompt, ctx, 0.0))
    rows = []
    for op in (o.name for o in layer_ops(spec)):
        n, c = shape_of(op, args.decode, args.tokens, ctx, args.prompt)
        try:
            r = alone(op, spec, n, c, args.tokens, dev, tele, args.alone_settle)
        except Exception as exc:  # noqa: BLE001 - one op's failure keeps the others' figures
            print(f"{op}: not timed alone: {type(exc).__name__}: {exc}", flush=True)
            torch.cuda.synchronize()
            continue
        r["profile_row_us"] = profile_rows[op]
        r["in_forward_us"] = in_forward.get(op)
        r["in_forward_kernels"] = sorted(names.get(op, ()))
        r["same_kernels"] = set(r["in_forward_kernels"]) == set(r["burst_kernels"])
        rows.append(r)
        print(f"{op}: row {r['row_us']:.1f} us, burst {r['burst_us']:.1f}, sustained "
              f"{r['sustained_us']:.1f}, own graph {r['graph_us']:.1f}, in the forward "
              f"{r['in_forward_us'] or float('nan'):.1f}", flush=True)
    if tele is not None:
        tele.stop()
    path = write_result("graph_kernels", {
        "env": environment(), "args": vars(args), "context": ctx,
        "forward_us": wall_us, "forward_clock": forward_clock,
        "kernel_us_per_layer": kernel_sum, "attribution_failures": failures,
        "kernels": sorted(({"kernel": k, "us_per_layer": t / args.forwards / layers}
                           for k, t in per_name.items()), key=lambda r: -r["us_per_layer"]),
        "ops": rows,
        "profile_layer_us": sum(r["profile_row_us"] for r in rows),
        "in_forward_layer_us": sum(r["in_forward_us"] or 0.0 for r in rows)})
    fc = forward_clock or {}
    print(f"{path}\nforward {wall_us / 1e3:.2f} ms = {wall_us / layers:.0f} us per layer at "
          f"{fc.get('clock_mhz', '?')} MHz, {fc.get('power_w', '?')} W; kernels "
          f"{kernel_sum:.0f} us per layer; profile rows "
          f"{sum(r['profile_row_us'] for r in rows):.0f} us per layer (context {ctx})")
    for f in failures:
        print(f"not attributed: {f}")
    for r in rows:
        r["kernel"] = (r["in_forward_kernels"] or ["?"])[0][:40]
        r["same"] = "yes" if r["same_kernels"] else "NO"
        r["mhz"] = (r["sustained_clock"] or {}).get("clock_mhz", float("nan"))
        r["fwd"] = r["in_forward_us"] if r["in_forward_us"] is not None else float("nan")
    print_table(rows, [("op", "op", ""), ("profile_row_us", "profile row", ".1f"),
                       ("row_us", "row now", ".1f"), ("burst_us", "burst", ".1f"),
                       ("sustained_us", "sustained", ".1f"), ("mhz", "MHz", ".0f"),
                       ("graph_us", "own graph", ".1f"), ("fwd", "in forward", ".1f"),
                       ("same", "same kernel", ""), ("kernel", "forward's kernel", "")])


if __name__ == "__main__":
    main()
