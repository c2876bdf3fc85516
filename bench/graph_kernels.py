"""GPU time of every kernel inside a Sequential forward's CUDA graph, against the profile's rows.

    PYTHONPATH=. python bench/graph_kernels.py [--decode 256] [--tokens 1024] [--context 1280]
        [--prompt 1024] [--settle 1.0] [--forwards 5]

Llama-3-8B, random bf16 weights, one batch of `--decode` decode rows (each with `--context`
cached tokens) and prompt chunks filling `--tokens` rows, laid out as `nanosched verify` lays
out a key (`benchmarks.common.bucket_batch`), run by Sequential and captured as a CUDA graph.
The graph is replayed back to back for `--settle` seconds (the clock settles under the power
cap), then `--forwards` replays are traced by CUPTI (torch.profiler). Per kernel name: GPU time
per layer (total / forwards / layers), against the shipped profile's kernel rows of each op at
that batch, which the search sums to price Sequential. The forward's wall time (events) and the
sum of its kernels tell how much of it is gaps. GPU only; JSON to $OUT or bench/results/.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import environment, print_table, write_result  # noqa: E402

from nanosched.autosearch.durations import op_context  # noqa: E402
from nanosched.autosearch.request import load_named_profile  # noqa: E402
from nanosched.benchmarks.common import bucket_batch, fitting_context  # noqa: E402
from nanosched.benchmarks.throughput import forward_pages  # noqa: E402
from nanosched.constants import PAGE_SIZE  # noqa: E402
from nanosched.models.spec import load_spec  # noqa: E402
from nanosched.runtime.backend import Backend  # noqa: E402
from nanosched.runtime.config import EngineConfig  # noqa: E402
from nanosched.runtime.device import CudaDevice  # noqa: E402
from nanosched.runtime.graphs import BucketRunner  # noqa: E402
from nanosched.runtime.loader import load_model  # noqa: E402
from nanosched.runtime.strategies import Sequential  # noqa: E402


def profile_rows(decode: int, tokens: int, context: float, prompt: int) -> dict[str, float]:
    """The shipped H100 profile's time of each op of a layer at this batch (us), as the
    search prices Sequential (`durations.op_context`)."""
    prof = load_named_profile("llama3-8b-tp1-h100")
    out = {}
    for op in ("kqv", "rope_append", "o", "add_norm_ffn", "ug", "act", "d", "add_norm_attn"):
        out[op] = prof.kernel_time_us(op, tokens)
    out["attn_decode"] = prof.kernel_time_us("attn_decode", decode, None,
                                             op_context("attn_decode", context, prompt))
    out["attn_prefill"] = prof.kernel_time_us("attn_prefill", tokens - decode, None,
                                              op_context("attn_prefill", context, prompt))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--context", type=int, default=1280)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--forwards", type=int, default=5)
    args = ap.parse_args()
    spec = load_spec("llama3-8b")
    dev = torch.device("cuda", 0)
    model = load_model(spec, "random", dev)
    pages = forward_pages(args.tokens, args.decode, args.context, args.prompt, PAGE_SIZE)
    ws = model.new_workspace(args.tokens, num_pages=pages)
    ctx = fitting_context(ws, args.tokens, args.decode, args.context, args.prompt)
    seqs, _ = bucket_batch(ws, args.tokens, args.decode, ctx, args.prompt, 10**8,
                           EngineConfig.graph_align)
    runner = BucketRunner(model, ws, Backend(CudaDevice()), Sequential(),
                          align=EngineConfig.graph_align,
                          max_pages=-(-max(ctx + 1, args.prompt) // PAGE_SIZE), capture=True)
    entry = runner.entry(runner.bucket(seqs))
    runner.run(entry, seqs)  # eager first (compiles), then captured
    graph = entry.graph
    assert graph is not None, "no CUDA graph was captured"
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.settle:
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.forwards):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3 / args.forwards
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.forwards):
            graph.replay()
        torch.cuda.synchronize()
    per_name: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0 \
                and "Memcpy" not in ev.name and "Memset" not in ev.name:
            per_name[ev.name] += ev.device_time_total
            count[ev.name] += 1
    layers = spec.num_layers
    kernels = sorted(({"kernel": name[:60], "us_per_layer": t / args.forwards / layers,
                       "calls_per_forward": count[name] / args.forwards}
                      for name, t in per_name.items()), key=lambda r: -r["us_per_layer"])
    rows = profile_rows(args.decode, args.tokens, ctx, args.prompt)
    kernel_sum = sum(r["us_per_layer"] for r in kernels)
    path = write_result("graph_kernels", {
        "env": environment(), "args": vars(args), "context": ctx,
        "forward_us": wall_us, "kernel_us_per_layer": kernel_sum, "kernels": kernels,
        "profile_rows_us": rows, "profile_layer_us": sum(rows.values())})
    print(f"{path}\nforward {wall_us / 1e3:.2f} ms = {wall_us / layers:.0f} us per layer "
          f"(LM head included); kernels {kernel_sum:.0f} us per layer; profile rows "
          f"{sum(rows.values()):.0f} us per layer (context {ctx})")
    print_table([{"op": k, "us": v} for k, v in rows.items()],
                [("op", "profile row", ""), ("us", "us", ".1f")])
    print_table(kernels[:20], [("kernel", "kernel", ""), ("us_per_layer", "us/layer", ".1f"),
                               ("calls_per_forward", "calls", ".0f")])


if __name__ == "__main__":
    main()
