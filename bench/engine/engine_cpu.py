"""CPU: what an engine step costs the CPU at a benchmark's scale, the model's work left out.

    PYTHONPATH=. python bench/engine/engine_cpu.py [--num-prompts 1000] [--input-len 1024]
        [--output-len 512] [--dense-batch 1024] [--pages 48405] [--steps 900]

The engine (scheduler, paged cache, bucket layout as `graphs="layout"` lays a batch out for a
CUDA graph, sampling bookkeeping, post-processing) over a one-layer model of tiny width whose
forward is replaced by a no-op, on `--num-prompts` requests that all arrive at once, as
`nanosched bench` serves them. With the asynchronous loop a step's CPU work overlaps the GPU's
forward of the step before, so the GPU waits for the CPU only where a step costs the CPU more
than a forward costs the GPU (docs/runtime.md, 'Time outside the forwards'). Prints the median
step time over the whole run and over its middle third (the steady state), and with
`--profile` the functions that cost most there. JSON to $OUT or bench/results/.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

import nanosched.runtime.engine as engine_module
import nanosched.runtime.graphs as graphs_module
from bench._common import results_dir
from nanosched.models.model import CausalLM
from nanosched.models.spec import ModelSpec
from nanosched.models.weights import init_random
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.engine import Engine
from nanosched.runtime.requests import Request, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--dense-batch", type=int, default=1024)
    ap.add_argument("--pages", type=int, default=48405, help="KV pages (the FP8 H100 run's)")
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--profile", action="store_true",
                    help="profile the middle third (cProfile: its steps then cost more)")
    args = ap.parse_args()
    spec = ModelSpec(name="tiny", arch="llama", hidden_size=64, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=97,
                     max_position_embeddings=args.input_len + args.output_len)
    model = CausalLM(spec)
    init_random(model, seed=0)
    noop = lambda *a, **k: None  # noqa: E731 - the forward, which the GPU runs
    graphs_module.run_program = engine_module.run_program = noop
    eng = Engine(model, EngineConfig(dense_batch=args.dense_batch, num_pages=args.pages,
                                     graphs="layout", graph_align=32))
    for i in range(args.num_prompts):
        eng.add_request(Request(i, [1] * args.input_len,
                                SamplingParams(max_tokens=args.output_len, ignore_eos=True)))
    times, prof = [], cProfile.Profile()
    third = args.steps // 3
    with torch.inference_mode():
        while eng.has_work and len(times) < args.steps:
            if len(times) == third and args.profile:
                prof.enable()
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
            if len(times) == 2 * third and args.profile:
                prof.disable()
    text = io.StringIO()
    if args.profile:
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(12)
    steady = times[third:2 * third]
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python", *sys.argv]), "args": vars(args),
           "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
           "steps": len(times), "median_ms": 1e3 * statistics.median(times),
           "steady_median_ms": 1e3 * statistics.median(steady),
           "note": "steady: the middle third of the steps" + (", timed under cProfile"
                                                               if args.profile else "")}
    path = results_dir() / f"engine_cpu-{datetime.now(timezone.utc):%Y%m%d}.json"
    path.write_text(json.dumps(out, indent=2))
    print(text.getvalue())
    print(path)
    print(f"{len(times)} steps: median {out['median_ms']:.2f} ms a step, steady state (the "
          f"middle third) {out['steady_median_ms']:.2f} ms")


if __name__ == "__main__":
    main()
