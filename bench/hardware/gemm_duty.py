"""A GEMM's time against what runs between its launches: back to back, or spaced by idle or
memory-bound work, as a Sequential layer spaces its GEMMs with attention and elementwise ops.

    PYTHONPATH=. python bench/hardware/gemm_duty.py [--rows 1024] [--launches 40] [--idle 0.3]

Llama-3-8B's four GEMMs (cuBLAS, as the profiler builds their rows) at `--rows` rows. Each
pattern starts after `--idle` seconds of an idle GPU and launches the GEMM `--launches` times;
CUDA events time every launch, so the series shows when the clock falls (the power cap). The
patterns:
- `back_to_back`: nothing between launches (what `profiler.timing.bench_us` times, less its
  L2 flush);
- `row`: `bench_us` itself, the profile's row;
- `sleep_xF`: a `torch.cuda._sleep` of F times the GEMM's first time after each launch (an
  idle SM array, little power);
- `stream_xF`: a device-to-device copy taking about F times the GEMM's time after each launch
  (an HBM stream, as decode attention draws).
Per pattern: the median of the last half of the launches, the first launch, and the NVML SM
clock and board power over the pattern.

Then the data: `ug` (x @ w_gate_up.T at `--rows` rows) back to back on operands of the same
shapes filled differently: N(0, 1) both (the profiler's scratch tensors), the model's weight
scale, zeros, and the normed activations and weights of a Llama-3-8B forward (seeded random
weights, one Sequential forward of a 256-decode batch laid out as `verify` lays out a key, its
decode rows attending to a zero-filled cache or to random K/V), so the table shows whether a
GEMM's time depends on the values it multiplies and where collapsed rows come from.
GPU only; JSON to $OUT or bench/results/; tables last.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench._common import environment, key_batch, print_table, write_result
from nanosched.models.spec import load_spec
from nanosched.profiler import impl_registry, timing
from nanosched.profiler.impl_registry import OpCall, ScratchSpace
from nanosched.profiler.telemetry import open_telemetry
from nanosched.runtime.loader import load_model

GEMMS = ("kqv", "o", "ug", "d")


def series(fn, gap, launches: int) -> list[float]:
    """Per-launch GPU time of `fn` (us), `gap()` queued after each launch."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(launches)]
    torch.cuda._sleep(timing.queue_cycles(launches * 60.0))  # the queue fills before it runs
    for a, b in events:
        a.record()
        fn()
        b.record()
        if gap is not None:
            gap()
    torch.cuda.synchronize()
    return [1e3 * a.elapsed_time(b) for a, b in events]


def forward_rows(model: Any, rows: int, random_cache: bool) -> torch.Tensor:
    """The final normed rows after one Sequential forward of `model`, the decode rows
    attending to a zero-filled cache or (`random_cache`) to random K/V."""
    kb = key_batch(model, rows, min(256, rows // 2), 1280, 1024, capture=False,
                   random_cache=random_cache)
    kb.runner.run(kb.entry, kb.seqs)
    torch.cuda.synchronize()
    return kb.ws.normed[:rows].clone()


def mean_abs_cos(x: torch.Tensor) -> float:
    """Mean |cosine| between distinct rows of `x` (0 for independent N(0, 1) rows, 1 when all
    rows point one way)."""
    u = torch.nn.functional.normalize(x.float(), dim=1)
    c = (u @ u.t()).abs()
    n = c.shape[0]
    return float((c.sum() - c.diagonal().sum()) / (n * (n - 1)))


def data_cases(spec: Any, dev: torch.device, rows: int, launches: int, idle: float,
               tele: Any) -> list[dict[str, Any]]:
    """`ug` back to back on operands filled in different ways (see the module docstring)."""
    model = load_model(spec, "random", dev)
    x_fwd = forward_rows(model, rows, random_cache=False)
    x_rand_cache = forward_rows(model, rows, random_cache=True)
    w_fwd = model.layers[-1].w_gate_up.detach().clone()
    del model
    n, k = w_fwd.shape
    std = 1 / spec.hidden_size ** 0.5  # init_random's w_gate_up scale
    randn = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.bfloat16)  # noqa: E731
    cases = {"randn x, randn w (profile rows)": (randn(rows, k), randn(n, k)),
             "randn x, w at the model's scale": (randn(rows, k), randn(n, k) * std),
             "forward's x, randn w": (x_fwd, randn(n, k)),
             "randn x, forward's w": (randn(rows, k), w_fwd),
             "forward's x and w": (x_fwd, w_fwd),
             "forward's x over a random cache, randn w": (x_rand_cache, randn(n, k)),
             "zeros x, randn w": (torch.zeros_like(x_fwd), randn(n, k)),
             "one randn row repeated as x, randn w": (randn(1, k).expand(rows, k).contiguous(),
                                                     randn(n, k))}
    out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
    res = []
    for name, (x, w) in cases.items():
        def fn(x=x, w=w):
            return torch.matmul(x, w.t(), out=out)

        fn()
        torch.cuda.synchronize()
        time.sleep(idle)
        t0 = time.perf_counter()
        times = series(fn, None, launches)
        r = tele.reading(t0, time.perf_counter()) if tele is not None else None
        res.append({"operands": name, "first_us": times[0],
                    "median_tail_us": statistics.median(times[len(times) // 2:]),
                    "series_us": times, "clock": r.to_json() if r is not None else None,
                    "x_stats": [float(x.float().std()), float((x == 0).float().mean())],
                    "x_rows_mean_abs_cos": mean_abs_cos(x),
                    "w_stats": [float(w.float().std()), float((w == 0).float().mean())]})
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--launches", type=int, default=40)
    ap.add_argument("--idle", type=float, default=0.3)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    spec = load_spec("llama3-8b")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tele = open_telemetry(0)
    src = torch.empty(1 << 28, dtype=torch.bfloat16, device=dev)  # 512 MB
    dst = torch.empty_like(src)
    copy_us = timing.bench_us(lambda: dst.copy_(src), dev, flush=False)
    results: list[dict[str, Any]] = []
    for op in GEMMS:
        ws = ScratchSpace(dev)
        call = OpCall(spec, 1, op, args.rows, 0, num_sms, "full", num_sms, ws, args.rows)
        kernel = impl_registry.get(op, "cublas").kernel(call)
        with kernel.scope():
            kernel.fn()
            torch.cuda.synchronize()
            time.sleep(args.idle)
            first = series(kernel.fn, None, 3)[0]
            patterns: dict[str, Any] = {"back_to_back": None, "row": "row"}
            for f in (0.5, 1.0, 2.0):
                cycles = int(timing.SLEEP_CYCLES_PER_US * f * first)
                patterns[f"sleep_x{f:g}"] = (lambda c=cycles: torch.cuda._sleep(c))
            for f in (1.0, 2.0):
                n = max(1 << 20, int(src.numel() * min(1.0, f * first / copy_us)))
                patterns[f"stream_x{f:g}"] = (lambda n=n: dst[:n].copy_(src[:n]))
            for name, gap in patterns.items():
                time.sleep(args.idle)
                t0 = time.perf_counter()
                if gap == "row":
                    times = [timing.bench_us(kernel.fn, dev)]
                else:
                    times = series(kernel.fn, gap, args.launches)
                r = tele.reading(t0, time.perf_counter()) if tele is not None else None
                tail = times[len(times) // 2:]
                results.append({"op": op, "rows": args.rows, "pattern": name,
                                "first_us": times[0], "median_tail_us": statistics.median(tail),
                                "series_us": times,
                                "clock": r.to_json() if r is not None else None})
        ws.clear()
    data = data_cases(spec, dev, args.rows, args.launches, args.idle, tele)
    env = environment()
    path = write_result("gemm_duty", {"env": env, "args": vars(args), "copy_512mb_us": copy_us,
                                      "results": results, "data": data})
    print(path)
    rows = []
    for r in results:
        c = r["clock"] or {}
        rows.append({"op": r["op"], "pattern": r["pattern"], "first": r["first_us"],
                     "tail": r["median_tail_us"], "mhz": c.get("clock_mhz", float("nan")),
                     "w": c.get("power_w", float("nan"))})
    print_table(rows, [("op", "op", ""), ("pattern", "pattern", ""),
                       ("first", "first us", ".1f"), ("tail", "median 2nd half us", ".1f"),
                       ("mhz", "MHz", ".0f"), ("w", "W", ".0f")])
    print_table(data, [("operands", "ug operands", ""), ("first_us", "first us", ".1f"),
                       ("median_tail_us", "median 2nd half us", ".1f"),
                       ("x_rows_mean_abs_cos", "x rows' mean |cos|", ".3f")])


if __name__ == "__main__":
    main()
