"""CPU launch time against GPU time of one forward, and where the GPU time goes, per op.

For Llama-3-8B (random bf16 weights) at dense batches 256..2048 (a third decode tokens with
1,280 tokens of context, the rest prefill chunks of 1,024-token prompts), per strategy:
- plan: KV-cache planning + batch metadata (CPU),
- build: the Program (CPU),
- launch: wall time of dispatching every op, without waiting for the GPU (CPU),
- gpu: CUDA-event time of the forward when the GPU is never starved (launched behind a sleep),
- per-op GPU time of each op summed over layers (ops timed one by one with events).
If launch > gpu, the forward is CPU-bound and CUDA graphs would pay.

    PYTHONPATH=. python bench/engine/overhead.py [--layers 32] [--batches 256,512,1024,2048]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from nanosched.benchmarks.common import cache_context, environment, plan_batch
from nanosched.models.spec import REGISTRY
from nanosched.runtime.backend import Backend
from nanosched.runtime.device import CudaDevice
from nanosched.runtime.loader import load_model
from nanosched.runtime.modelprogram import model_program
from nanosched.runtime.opsched import run_program
from nanosched.runtime.strategies import Sequential, TwoBatchOverlap


def batch(ws, dense: int, first_id: int):
    """Plan a mixed batch (a third decode tokens with 1,280 tokens of context, then 1,024-token
    prompt chunks); returns (meta, segments, ids to release, seconds the batch's plan took)."""
    n_dec = dense // 3
    cache_context(ws, n_dec, 1280, first_id)
    t = time.perf_counter()
    meta, segments, ids = plan_batch(ws, dense, n_dec, 1024, first_id)
    return meta, segments, ids, time.perf_counter() - t


def per_op_gpu_ms(program) -> dict[str, float]:
    out: dict[str, float] = {}
    for op in program.ops:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        op.run(0, program.num_tokens, __import__("nanosched.runtime.program",
                                                 fromlist=["x"]).DEFAULT_LAUNCH)
        b.record()
        b.synchronize()
        out[op.op] = out.get(op.op, 0.0) + a.elapsed_time(b)
    return out


def measure(model, ws, dense: int, strategy, reps: int = 5) -> dict:
    rows = {"plan_ms": [], "build_ms": [], "launch_ms": [], "gpu_ms": []}
    for rep in range(reps + 1):
        meta, segments, ids, plan_s = batch(ws, dense, first_id=rep * 1_000_000)
        t = time.perf_counter()
        program = model_program(model, ws, meta, segments)
        build_s = time.perf_counter() - t
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))  # keep the GPU busy so the CPU's launches queue up
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t = time.perf_counter()
        run_program(program, strategy, Backend(CudaDevice()))
        launch_s = time.perf_counter() - t
        b.record()
        b.synchronize()
        if rep:  # the first is warm-up
            rows["plan_ms"].append(plan_s * 1e3)
            rows["build_ms"].append(build_s * 1e3)
            rows["launch_ms"].append(launch_s * 1e3)
            rows["gpu_ms"].append(a.elapsed_time(b))
        for r in ids:
            ws.kv.release(r)
    med = {k: statistics.median(v) for k, v in rows.items()}
    meta, segments, ids, _ = batch(ws, dense, first_id=9_000_000)
    med["per_op_gpu_ms"] = per_op_gpu_ms(model_program(model, ws, meta, segments))
    for r in ids:
        ws.kv.release(r)
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", default="256,512,1024,2048")
    args = ap.parse_args()
    spec = REGISTRY["llama3-8b"]
    spec = spec.__class__(**{**spec.to_json(), "num_layers": args.layers})
    model = load_model(spec, "random", torch.device("cuda"))
    ws = model.new_workspace(2048, num_pages=60_000)
    results = []
    with torch.inference_mode():
        for dense in map(int, args.batches.split(",")):
            for strategy in (Sequential(), TwoBatchOverlap()):
                m = measure(model, ws, dense, strategy)
                results.append({"dense_batch": dense, "strategy": strategy.name, **m})
    out = {"environment": environment(torch.device("cuda")), "layers": args.layers,
           "results": results}
    path = Path(os.environ.get("OUT", "bench/results")) / "overhead.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"{'T':>5} {'strategy':>10} {'plan':>6} {'build':>6} {'launch':>7} {'gpu':>7}  "
          "top ops (gpu ms)")
    for r in results:
        top = sorted(r["per_op_gpu_ms"].items(), key=lambda kv: -kv[1])[:5]
        print(f"{r['dense_batch']:>5} {r['strategy']:>10} {r['plan_ms']:6.1f} "
              f"{r['build_ms']:6.1f} {r['launch_ms']:7.1f} {r['gpu_ms']:7.1f}  " +
              ", ".join(f"{k} {v:.1f}" for k, v in top))


if __name__ == "__main__":
    main()
