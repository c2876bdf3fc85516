"""Where GPU memory goes between engines of one process at tp > 1 (`bench --compare` builds
three): the KV pages each engine agrees on (the least any rank has room for), and rank 0's free
memory after each engine closes, first as `bench` leaves it (references dropped, the caching
allocator emptied), then after a garbage collection too (memory that comes back only then was
held by a reference cycle through the closed engine), then after clearing PyTorch's cuBLAS
workspaces (one per handle and stream used, 32 MiB each on Hopper, which `empty_cache` keeps:
memory that comes back only then was a closed engine's streams' workspaces; a private PyTorch
call, skipped where this torch lacks it).

    PYTHONPATH=. python bench/engine/tp_memory.py --model llama3-70b --tp 4 [--engines 3]
        [--prompts 256] [--json OUT.json]

Each engine serves --prompts requests of 1,024 prompt (fewer on a model of a shorter context)
and 16 output tokens on Sequential with CUDA graphs (so it captures graphs and fills its cache),
its KV pages sized by the memory left (as a server's), then closes. Needs --tp GPUs (on the CPU,
through gloo, it only checks that it runs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from dataclasses import replace
from typing import Any

import torch

from nanosched.benchmarks.common import environment
from nanosched.models.spec import load_spec
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.loader import (
    build_engine,
    choose_strategy,
    load_model,
    resolve_device,
    resolve_weights,
)
from nanosched.runtime.ranks.group import start_ranks
from nanosched.runtime.requests import make_requests

MIB = 2**20


def rank0_memory(device: torch.device) -> dict[str, float]:
    """Rank 0's free device memory and what PyTorch's allocator holds, in MiB (zeros on the
    CPU, where the script only checks that it runs)."""
    if device.type != "cuda":
        return {"free_mib": 0.0, "allocated_mib": 0.0, "reserved_mib": 0.0}
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return {"free_mib": free / MIB, "allocated_mib": torch.cuda.memory_allocated(device) / MIB,
            "reserved_mib": torch.cuda.memory_reserved(device) / MIB}


def serve_once(model: Any, cfg: EngineConfig, group: Any, prompts: int, seed: int) -> int:
    """Build an engine, serve the requests to the end, close it; its agreed KV pages."""
    spec = model.spec
    choice = choose_strategy(replace(cfg, schedule="sequential"), spec, model.device)
    prompt = min(1024, spec.max_position_embeddings - 16)  # a small CPU model's context
    reqs = make_requests(None, prompt, 16, prompts, spec.vocab_size,
                         spec.max_position_embeddings, seed)
    with build_engine(model, cfg, choice, ranks=group) as loaded, torch.inference_mode():
        engine = loaded.engine
        for r in reqs:
            engine.add_request(r)
        while engine.has_work:
            engine.step()
        pages = loaded.config.num_pages
    return int(pages)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spec = load_spec(args.model)
    device = resolve_device("auto", 0)
    cfg = EngineConfig(model=args.model, tp=args.tp, dense_batch=2048,
                       graphs="on" if device.type == "cuda" else "off")
    weights = resolve_weights(args.model, None)
    rows = []
    with start_ranks(cfg, weights, device) as group:
        model = load_model(spec, weights, device, cfg.seed, group.tp, cfg.kernels)
        before = rank0_memory(device)
        for i in range(args.engines):
            pages = serve_once(model, cfg, group, args.prompts, i)
            closed = rank0_memory(device)  # as bench leaves it: references gone, cache emptied
            gc.collect()
            collected = rank0_memory(device)
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None and device.type == "cuda":
                clear()
            cublas = rank0_memory(device)
            rows.append({"engine": i, "kv_pages": pages, "closed": closed,
                         "after_gc": collected,
                         "after_cublas_clear": cublas if clear is not None else None})
            print(f"engine {i}: {pages} KV pages; rank 0 free after close "
                  f"{closed['free_mib']:.0f} MiB (allocated {closed['allocated_mib']:.0f}), "
                  f"after gc {collected['free_mib']:.0f} MiB (allocated "
                  f"{collected['allocated_mib']:.0f}), after clearing cuBLAS workspaces "
                  f"{cublas['free_mib']:.0f} MiB (allocated {cublas['allocated_mib']:.0f}"
                  f"{'' if clear else ', not cleared: no such call'}); before any engine "
                  f"{before['free_mib']:.0f} MiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args) | {"graphs": cfg.graphs, "dense_batch": 2048,
                                               "NCCL_GRAPH_REGISTER":
                                                   os.environ.get("NCCL_GRAPH_REGISTER")},
                       "environment": environment(device) | {"num_gpus": args.tp},
                       "before": before, "engines": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
