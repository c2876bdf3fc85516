"""CPU: admission policies on a benchmark's workload, through the request scheduler and paged cache.

Runs `bench.analysis.kvsim.KVSim` (the engine's bookkeeping over a fake model, no GPU) on
requests that all arrive at once, as `nanosched bench` serves them, with the KV cache of that
benchmark's GPU run, and prints per policy: iterations, mean tokens per iteration (and the
prompt + output tokens per iteration, which excludes recomputed ones), the share of iterations
at the dense batch, preemptions and the tokens recomputed. Iterations are not time: a GPU run
measures that; this shows what the request scheduler gives the GPU. With `--max-tokens` above
the output length, requests declare that many but stop (EOS) at their output length, as chat
requests do.

    PYTHONPATH=. python bench/analysis/admission_sim.py --pages 24959 \\
        --input-len 1024 --output-len 512 --num-prompts 1000 --dense-batch 1024 --kv-bytes-per-token
        131072 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

from bench.analysis.kvsim import KVSim, sim_cost
from nanosched.runtime.kv_pool import AdmissionConfig
from nanosched.runtime.requests import Request, SamplingParams, make_requests

POLICIES = [("reserve", {"policy": "reserve"}), ("predict", {"policy": "predict"})] + [
    (f"use h={h} {mode}", {"policy": "use", "headroom": h, "preemption": mode})
    for h in (0.0, 0.02, 0.05) for mode in ("recompute", "swap")]


def workload(args: argparse.Namespace) -> tuple[list[Request], dict[int, int]]:
    """The requests (max_tokens = `--max-tokens` or the output length) and where each stops."""
    if args.workload:
        made = make_requests(args.workload, None, None, args.num_prompts, 1000, 1 << 20,
                             args.seed)
        lengths = [(len(r.prompt_ids), r.params.max_tokens) for r in made]
    else:
        lengths = [(args.input_len, args.output_len)] * args.num_prompts
    reqs, stops = [], {}
    for i, (p, o) in enumerate(lengths):
        cap = max(o, args.max_tokens or o)
        reqs.append(Request(i, [1] * p, SamplingParams(max_tokens=cap)))
        stops[i] = o
    return reqs, stops


def run_policy(args: argparse.Namespace, admission: dict) -> dict:
    # the sim stores 4 bytes per token: scale the host budget to the model's bytes per token
    swap_tokens = args.swap_space_gib * 2**30 / args.kv_bytes_per_token
    cfg = AdmissionConfig(**admission, swap_space_gib=swap_tokens * 4 / 2**30)
    reqs, stops = workload(args)
    sim = KVSim(num_pages=args.pages, page_size=args.page_size, dense_batch=args.dense_batch,
                admission=cfg, decode_align=args.align, check=False, cost=sim_cost(True),
                stop_at=stops)
    for r in reqs:
        sim.add(r)
    t0 = time.perf_counter()
    steps = sim.run(10**7)
    sizes = sim.batch_sizes
    stats = sim.scheduler.pool.stats.as_dict() if sim.scheduler.pool else {}
    useful = sum(len(r.prompt_ids) + len(r.output_ids) for r in reqs)
    return {"iterations": steps, "tokens_per_iteration": sum(sizes) / len(sizes),
            "useful_tokens_per_iteration": useful / len(sizes),
            "full_batch_share": sim.scheduler.stats.full_batches / sim.scheduler.stats.batches,
            "preemption": stats, "sim_s": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pages", type=int, default=24959, help="KV pages (H100, llama3-8b bf16)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--workload", default=None, help="sharegpt, lmsys or splitwise lengths")
    p.add_argument("--max-tokens", type=int, default=None, help="declared max_tokens")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--dense-batch", type=int, default=1024)
    p.add_argument("--align", type=int, default=32, help="decode rows of a graph bucket")
    p.add_argument("--kv-bytes-per-token", type=int, default=131072, help="llama3-8b bf16")
    p.add_argument("--swap-space-gib", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=None, help="comma-separated names to run")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    chosen = set(args.policies.split(",")) if args.policies else None
    out = {"what": "CPU simulation of the request scheduler and paged cache "
                   "(bench/analysis/kvsim.py): iterations, not time", "command": " ".join(sys.argv),
           "date": datetime.date.today().isoformat(), "args": vars(args), "runs": {}}
    print(f"{'policy':22} {'iters':>6} {'tok/it':>7} {'useful':>7} {'full':>5} "
          f"{'recomp':>6} {'swap':>5} {'recomp tok':>10}")
    for name, admission in POLICIES:
        if chosen and name not in chosen:
            continue
        r = out["runs"][name] = run_policy(args, admission)
        s = r["preemption"]
        print(f"{name:22} {r['iterations']:6d} {r['tokens_per_iteration']:7.1f} "
              f"{r['useful_tokens_per_iteration']:7.1f} {100 * r['full_batch_share']:4.0f}% "
              f"{s.get('recomputed', 0):6d} {s.get('swapped', 0):5d} "
              f"{s.get('recomputed_tokens', 0):10d}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
