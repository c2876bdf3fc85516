"""`nanosched bench`: offline throughput and latency of the engine under a scheduling strategy.

Throughput as NanoFlow defines it: (prompt + output tokens) / wall time, in total and per GPU,
and as a share of the optimal throughput, measured GEMM peak / (2 x parameters) (NanoFlow Eq. 5;
the peak is measured in the same run on a GPU). Latency per output token of a request is its
end-to-end time (arrival to last token) over its output length; NanoFlow's normalized latency
is their mean (§6.3). Benchmark mode ignores EOS and generates each request's given length.
"""

from __future__ import annotations

import datetime
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from nanosched.errors import ConfigError
from nanosched.models.spec import ModelSpec, load_spec
from nanosched.runtime.requests import Request, make_requests, poisson_arrivals


@dataclass(frozen=True)
class BenchConfig:
    model: str
    tp: int = 1
    weights: str = "random"
    input_len: int | None = None
    output_len: int | None = None
    workload: str | None = None
    num_prompts: int = 100
    dense_batch: int | None = None  # None: auto
    schedule: str = "sequential"
    request_rate: float = float("inf")
    seed: int = 0
    device: str = "auto"
    mem_util: float = 0.85
    page_size: int = 16


def _device(cfg: BenchConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {cfg.device!r}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible")
    return torch.device(cfg.device)


def build_model(spec: ModelSpec, weights: str, device: torch.device, seed: int) -> Any:
    from nanosched.models.checkpoint import load_checkpoint
    from nanosched.models.model import CausalLM
    from nanosched.models.weights import init_random

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = CausalLM(spec, dtype=dtype, device=device)
    if weights == "random":
        init_random(model, seed)
    else:
        load_checkpoint(model, weights)
    return model


def kv_pages(model: Any, dense_batch: int, page_size: int, mem_util: float,
             requests: list[Request]) -> int:
    """Pages that fit in the GPU memory left after weights and buffers (CPU: what the
    requests could ever need, at most 1 GiB)."""
    spec = model.spec
    page_bytes = 2 * spec.num_layers * page_size * spec.num_kv_heads * spec.head_dim * \
        model.dtype.itemsize
    need = sum(-(-r.peak_tokens // page_size) + 1 for r in requests)
    if model.device.type != "cuda":
        return max(1, min(need, (1 << 30) // page_bytes))
    free, total = torch.cuda.mem_get_info(model.device)
    workspace = 64 * dense_batch * (spec.hidden_size + spec.intermediate_size) * 2
    budget = free - (1 - mem_util) * total - workspace
    if budget < page_bytes * 2:
        raise ConfigError(f"no GPU memory left for the KV cache of {spec.name!r} "
                          f"({free / 2**30:.1f} GiB free)")
    return int(min(need, budget // page_bytes))


def measured_gemm_tflops(device: torch.device) -> float | None:
    """bf16 GEMM peak at 8192^3 on `device` (None on the CPU)."""
    if device.type != "cuda":
        return None
    from triton.testing import do_bench

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return 2 * n**3 / ms / 1e9


def summarize(reqs: list[Request], elapsed_s: float, tp: int, params: int,
              gemm_tflops: float | None) -> dict[str, Any]:
    prompt = sum(r.prompt_len for r in reqs)
    output = sum(len(r.output_ids) for r in reqs)
    per_token = np.array([(r.finish_s - r.arrival_s) / max(1, len(r.output_ids)) for r in reqs])
    ttft = np.array([r.first_token_s - r.arrival_s for r in reqs])
    total = (prompt + output) / elapsed_s
    optimal = gemm_tflops * 1e12 / (2 * params) if gemm_tflops else None
    return {
        "requests": len(reqs), "prompt_tokens": prompt, "output_tokens": output,
        "elapsed_s": elapsed_s, "tokens_per_s": total, "tokens_per_s_per_gpu": total / tp,
        "output_tokens_per_s": output / elapsed_s,
        "optimal_tokens_per_s_per_gpu": optimal,
        "percent_of_optimal": 100 * total / tp / optimal if optimal else None,
        "normalized_latency_s": float(per_token.mean()),
        "latency_per_output_token_p99_s": float(np.percentile(per_token, 99)),
        "ttft_mean_s": float(ttft.mean()), "ttft_p99_s": float(np.percentile(ttft, 99)),
    }


def environment(device: torch.device) -> dict[str, Any]:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__,
           "command": " ".join(sys.argv)}
    if device.type == "cuda":
        import triton

        env |= {"device": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                "triton": triton.__version__,
                "num_sms": torch.cuda.get_device_properties(device).multi_processor_count}
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return env


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Build the model and engine, serve every request, return the figures as a dict."""
    from nanosched.runtime.engine import Engine
    from nanosched.runtime.strategies import Sequential

    if cfg.tp != 1:
        raise ConfigError("--tp > 1 is not benchmarked yet: run with --tp 1")
    if cfg.schedule != "sequential":
        raise ConfigError(f"--schedule {cfg.schedule!r}: only 'sequential' is supported until "
                          f"schedule replay lands")
    spec = load_spec(cfg.model)
    device = _device(cfg)
    reqs = make_requests(cfg.workload, cfg.input_len, cfg.output_len, cfg.num_prompts,
                         spec.vocab_size, spec.max_position_embeddings, cfg.seed)
    poisson_arrivals(reqs, cfg.request_rate, cfg.seed)
    dense = cfg.dense_batch or (2048 if device.type == "cuda" else 256)
    model = build_model(spec, cfg.weights, device, cfg.seed)
    gemm = measured_gemm_tflops(device)
    pages = kv_pages(model, dense, cfg.page_size, cfg.mem_util, reqs)
    engine = Engine(model, dense_batch=dense, num_pages=pages, page_size=cfg.page_size,
                    strategy=Sequential(), seed=cfg.seed)
    for r in reqs:
        engine.add_request(r)
    bar = _progress(len(reqs), progress)
    start = time.perf_counter()
    engine.t0 = start
    with torch.inference_mode():
        while engine.batcher.has_work or engine._in_flight:
            bar.update(len(engine.step()))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    bar.close()
    return {"config": asdict(cfg) | {"dense_batch": dense, "kv_pages": pages},
            "environment": environment(device), "model_params": spec.num_params(),
            "gemm_tflops_8192": gemm, "strategy": engine.strategy.name,
            "fallbacks": engine.stats.fallbacks, "iterations": engine.stats.iterations,
            "results": summarize(reqs, elapsed, cfg.tp, spec.num_params(active=True), gemm)}


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=not enabled, file=sys.stderr)
