"""`nanosched bench`: offline throughput and latency of the engine under a scheduling strategy.

Throughput as NanoFlow defines it: (prompt + output tokens) / wall time, in total and per GPU,
and as a share of the optimal throughput, measured GEMM peak / (2 x parameters) (NanoFlow Eq. 5;
the peak is measured in the same run on a GPU). Latency per output token of a request is its
end-to-end time (arrival to last token) over its output length; NanoFlow's normalized latency
is their mean (§6.3). Benchmark mode ignores EOS and generates each request's given length.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from nanosched.benchmarks.common import environment, measured_gemm_tflops
from nanosched.benchmarks.full_forward import engine_forward_ms, forward_pages
from nanosched.benchmarks.report import AFTER, run_ratio
from nanosched.constants import SEQUENTIAL
from nanosched.errors import ConfigError
from nanosched.models.spec import ModelSpec, load_spec
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.loader import (
    StrategyChoice,
    build_engine,
    check_engine_flags,
    choose_strategy,
    kv_pages,
    load_model,
    page_bytes,
    reserve_bytes,
    resolve_dense_batch,
    resolve_device,
    resolve_graphs,
    resolve_weights,
)
from nanosched.runtime.requests import Request, check_request_rate, make_requests, poisson_arrivals


@dataclass(frozen=True)
class BenchConfig:
    """`nanosched bench`: the engine (model, weights, schedule, dense batch, graphs, ...) and
    the workload served on it.

    `engine.graphs` may also be "both": every strategy eager, then with CUDA graphs.
    `warmup_prompts` untimed requests are served on each run's engine before its timed ones
    (None: 64 on a GPU, 0 on the CPU), so that no run pays Triton compilation, allocator growth
    or graph captures that a later run would reuse.
    """

    engine: EngineConfig
    input_len: int | None = None
    output_len: int | None = None
    workload: str | None = None
    num_prompts: int = 100
    compare: bool = False  # also run Sequential first, on the same requests, in this process
    request_rate: float = float("inf")
    warmup_prompts: int | None = None


def _spread(values: list[float], prefix: str) -> dict[str, float | None]:
    """`<prefix>_mean_s`, `_median_s` and `_p99_s` of `values` (None when there are none)."""
    if not values:
        return {f"{prefix}_{k}_s": None for k in ("mean", "median", "p99")}
    a = np.asarray(values, dtype=float)
    return {f"{prefix}_mean_s": float(a.mean()), f"{prefix}_median_s": float(np.median(a)),
            f"{prefix}_p99_s": float(np.percentile(a, 99))}


def summarize(reqs: list[Request], elapsed_s: float, tp: int, params: int,
              gemm_tflops: float | None,
              token_times: dict[int, list[float]] | None = None) -> dict[str, Any]:
    """The figures of one run, in seconds and per second (`report.REPORT_ROWS` names them).

    TTFT: arrival to first token; TPOT (a request's time per output token after its first, as
    vLLM's): (last - first token) / (outputs - 1), requests with two or more outputs; ITL: the
    gaps between a request's consecutive tokens, from `token_times` (request id -> the clock
    at each token)."""
    prompt = sum(r.prompt_len for r in reqs)
    output = sum(len(r.output_ids) for r in reqs)
    per_token = np.array([(r.finish_s - r.arrival_s) / max(1, len(r.output_ids)) for r in reqs])
    ttft = [r.first_token_s - r.arrival_s for r in reqs]
    tpot = [(r.finish_s - r.first_token_s) / (len(r.output_ids) - 1) for r in reqs
            if len(r.output_ids) > 1]
    itl = [b - a for times in (token_times or {}).values()
           for a, b in zip(times, times[1:], strict=False)]
    total = (prompt + output) / elapsed_s
    optimal = gemm_tflops * 1e12 / (2 * params) if gemm_tflops else None
    return {
        "requests": len(reqs), "prompt_tokens": prompt, "output_tokens": output,
        "elapsed_s": elapsed_s, "requests_per_s": len(reqs) / elapsed_s,
        "tokens_per_s": total, "tokens_per_s_per_gpu": total / tp,
        "output_tokens_per_s": output / elapsed_s,
        "optimal_tokens_per_s_per_gpu": optimal,
        "percent_of_optimal": 100 * total / tp / optimal if optimal else None,
        "normalized_latency_s": float(per_token.mean()),
        "latency_per_output_token_p99_s": float(np.percentile(per_token, 99)),
        **_spread(ttft, "ttft"), **_spread(tpot, "tpot"), **_spread(itl, "itl"),
    }


GRAPH_RUNS = {"off": (False,), "on": (True,), "both": (False, True)}


def set_info(sset: Any, num_layers: int) -> dict[str, Any]:
    """What a run records of the schedule set it replays: its size, and the predictions of the
    entry of the steady state's full batch (`ScheduleSet.full`), whose mix every run's
    full-batch forward is timed at."""
    full = sset.full
    info: dict[str, Any] = {"set_entries": len(sset.entries),
                            "set_pipelines": len(sset.pipelines),
                            "schedule_format": sset.source_format,
                            "dense_batch": sset.dense_batch}
    if full is not None:
        info |= {"num_decode": full.num_decode,
                 "predicted_period_us": full.forward_us / num_layers,
                 "predicted_speedup": full.speedup}
    return info


def shape_report(stats: Any, sset: Any, forwards: dict[tuple[int, int], list[float]],
                 top: int = 8) -> list[dict[str, Any]]:
    """The batch shapes (D decode rows, T rows) the run ran most, with their count; the median
    GPU time of the run's own forwards at that shape (`forwards`, `Engine.forward_ms_by_shape`:
    metadata writes and layers, no LM head), over its timed iterations; and, for a set, the
    entry that ran them (kind, its key, the key's predicted forward time and gain) and the set's
    prediction at the shape itself (`ScheduleSet.predict_us`, interpolated between keys)."""
    rows = []
    for (d, t), n in stats.shapes.most_common(top):
        row: dict[str, Any] = {"num_decode": d, "num_tokens": t, "iterations": n}
        if times := forwards.get((d, t)):
            row |= {"forward_ms": float(np.median(times)), "forward_iterations": len(times)}
        if sset is not None:
            e = sset.entry(d, t)
            pred = sset.predict_us(d, t)
            row |= {"entry": "none"} if e is None else \
                {"entry": e.kind, "key": list(e.key), "key_forward_ms": e.forward_us / 1e3,
                 "key_speedup": e.speedup,
                 "predicted_forward_ms": pred / 1e3 if pred is not None else None}
        rows.append(row)
    return rows


@dataclass
class _Run:
    name: str
    choice: StrategyChoice
    info: dict[str, Any] = field(default_factory=dict)
    graphs: bool = False


def _runs(cfg: BenchConfig, spec: ModelSpec, device: torch.device, graphs: str) -> list[_Run]:
    """With --compare: Sequential, the strategy --schedule names, Sequential again (A-B-A, so
    a drift of the GPU over the runs, e.g. its clock as it warms under the power cap, falls
    on both sides of the strategy); else the strategy alone. Each once per graph mode asked
    for (graphed runs are named `<name>+graphs`)."""
    eng = cfg.engine
    seq = choose_strategy(replace(eng, schedule=SEQUENTIAL), spec, device)
    main = choose_strategy(eng, spec, device)
    named = [(SEQUENTIAL, seq)] if cfg.compare else []
    if not (named and main.name == SEQUENTIAL):
        named.append(("schedule" if main.schedule is not None else main.name, main))
        if cfg.compare:
            named.append((AFTER, seq))
    runs = []
    for name, c in named:
        info = {}
        if c.schedule is not None:
            info = {"schedule": c.name.removeprefix("replay:"), "forced_past": c.forced_past,
                    **set_info(c.schedule, spec.num_layers)}
        runs += [_Run(name + ("+graphs" if g else ""), c, info, g) for g in GRAPH_RUNS[graphs]]
    return runs


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Build the model once; serve every request with each strategy asked for (the same
    requests, one engine after another in this process); return the figures as a dict."""
    eng = cfg.engine
    if eng.model is None:
        raise ConfigError("--model is required")
    check_request_rate(cfg.request_rate, cfg.num_prompts)
    spec = load_spec(eng.model)
    spec.check_tp(eng.tp)
    device = resolve_device(eng.device, 0 if eng.tp > 1 else None)
    check_engine_flags(eng, spec, device)
    graphs = resolve_graphs(eng.graphs, device, tuple(GRAPH_RUNS))
    runs = _runs(cfg, spec, device, graphs)
    dense = resolve_dense_batch(eng.dense_batch, runs[-1].choice, device)
    warm = cfg.warmup_prompts if cfg.warmup_prompts is not None else \
        default_warmup(spec, device)
    if warm < 0:
        raise ConfigError(f"--warmup-prompts must be >= 0, got {warm}")
    weights = resolve_weights(eng.model, eng.weights)
    copy_engine = any(r.choice.uses_copy_engine() for r in runs)
    with _ranks(eng, weights, device, copy_engine) as group:
        return _bench(cfg, spec, device, graphs, runs, dense, warm, weights, group, progress,
                      copy_engine)


CPU_WARMUP_PROMPTS = 8  # on the CPU, for a model of at most CPU_WARMUP_MAX_PARAMS
CPU_WARMUP_MAX_PARAMS = 1e9


def default_warmup(spec: ModelSpec, device: torch.device) -> int:
    """Untimed requests before each run: 64 on a GPU; on the CPU 8 where they are cheap (a
    model of at most 1B parameters: stories15m's first requests pay the allocator's and the
    kernels' first calls, 2.3-2.8 s mean TTFT cold against 242 ms warm), else none."""
    if device.type == "cuda":
        return 64
    return CPU_WARMUP_PROMPTS if spec.num_params() <= CPU_WARMUP_MAX_PARAMS else 0


def _ranks(eng: EngineConfig, weights: str, device: torch.device, copy_engine: bool) -> Any:
    """At tp > 1 the group of ranks (this process is rank 0), else nothing to hold."""
    if eng.tp == 1:
        return contextlib.nullcontext()
    from nanosched.runtime.ranks.group import start_ranks

    return start_ranks(eng, weights, device, copy_engine)


def _bench(cfg: BenchConfig, spec: ModelSpec, device: torch.device, graphs: str,
           runs: list[_Run], dense: int, warm: int, weights: str, group: Any,
           progress: bool, copy_engine: bool = False) -> dict[str, Any]:
    """`run_bench` once the group of ranks (None at tp = 1) is up; `copy_engine`: a run's
    schedule uses the copy-engine all-reduce (every rank maps its buffers)."""
    eng = cfg.engine
    model = load_model(spec, weights, device, eng.seed, group.tp if group else None,
                       eng.kernels, copy_engine=copy_engine, quantization=eng.quantization,
                       dtype=eng.dtype)
    precision = "fp8" if model.quantization == "fp8" else "bf16"
    loaded_bytes = torch.cuda.memory_allocated(model.device) \
        if model.device.type == "cuda" else None
    gemm = measured_gemm_tflops(device, precision)
    record = {k: v for k, v in asdict(cfg).items() if k != "engine"} | \
        {k: v for k, v in asdict(eng).items() if k not in ("kernels", "eos_ids", "admission")}
    record["quantization"] = model.quantization
    adm = eng.admission
    record |= {"weights": weights, "admission": adm.policy, "kv_headroom": adm.headroom,
               "preemption": adm.preemption, "swap_space_gib": adm.swap_space_gib,
               "decode_attention": eng.kernels.decode_impl, "collective": eng.kernels.network}
    out: dict[str, Any] = {"config": record | {"dense_batch": dense, "graphs": graphs},
                           "environment": environment(device) | {"num_gpus": eng.tp},
                           "model_params": spec.num_params(),
                           # this rank's parameters, and what the GPU held once they had loaded
                           # (a model-dtype copy of a quantised weight left behind shows there)
                           "weight_bytes": sum(p.numel() * p.element_size()
                                               for p in model.parameters()),
                           "gpu_bytes_after_load": loaded_bytes,
                           "gemm_tflops_8192": gemm, "gemm_precision": precision,
                           "runs": {}, "warmup_prompts": warm}
    # every run times its full-batch forward on the same batch: the schedule's mix if any
    num_decode = next((r.info["num_decode"] for r in runs if r.info), None)
    for r in runs:
        run_cfg = replace(eng, dense_batch=dense, graphs="on" if r.graphs else "off",
                          admission=replace(eng.admission, gemm_tflops=gemm))
        out["runs"][r.name] = _serve(cfg, run_cfg, model, gemm, r, warm, progress, num_decode,
                                     group)
    done = out["runs"]
    # each strategy against Sequential in the same graph mode, then graphs against eager
    seq = {False: SEQUENTIAL, True: f"{SEQUENTIAL}+graphs"}
    out["ratios"] = {r.name: run_ratio(done, r.name, seq[r.graphs]) for r in runs
                     if r.name != seq[r.graphs] and seq[r.graphs] in done
                     and not r.name.startswith(AFTER)}
    out["ratios"] |= {f"{r.name} vs eager": run_ratio(done, r.name, eager) for r in runs
                      if r.graphs and (eager := r.name.removesuffix("+graphs")) in done
                      and not r.name.startswith(AFTER)}
    if len(out["ratios"]) == 1:  # the one comparison (kept for older readers)
        out["ratio"] = next(iter(out["ratios"].values()))
    return out


def _serve(cfg: BenchConfig, run_cfg: EngineConfig, model: Any, gemm: float | None, run: _Run,
           warm: int, progress: bool, num_decode: int | None, group: Any = None
           ) -> dict[str, Any]:
    """Serve `warm` untimed requests, then the timed ones, on one engine (so graphs captured in
    the warm-up are replayed in the run, as a server captures before it serves); then time a
    full-batch forward with `num_decode` decode tokens (a third of the batch when None)."""
    from nanosched.runtime.stats import EngineStats

    spec, seed = model.spec, run_cfg.seed
    reqs = make_requests(cfg.workload, cfg.input_len, cfg.output_len, cfg.num_prompts,
                         spec.vocab_size, spec.max_position_embeddings, seed)
    poisson_arrivals(reqs, cfg.request_rate, seed)
    warm_reqs = make_requests(cfg.workload, cfg.input_len, cfg.output_len, warm,
                              spec.vocab_size, spec.max_position_embeddings, seed + 1) \
        if warm else []
    dense = run_cfg.dense_batch
    n_dec = num_decode or dense // 3
    limit = run_cfg.max_context or spec.max_position_embeddings  # positions the model has
    prompt = min(cfg.input_len or 1024, limit)
    context = min(prompt + (cfg.output_len or 512) // 2, limit - 1)
    if run_cfg.num_pages is None:  # room for the requests and for the full-batch forward after
        args = (model, dense, run_cfg.page_size, run_cfg.mem_util)
        forward = forward_pages(dense, n_dec, context, prompt, run_cfg.page_size)
        run_cfg = replace(run_cfg, num_pages=max(
            kv_pages(*args, reqs + warm_reqs, run_cfg.kv_dtype),
            min(forward, kv_pages(*args, None, run_cfg.kv_dtype))))
    token_times: dict[int, list[float]] = {}

    def on_token(req: Request, token: int) -> None:
        token_times.setdefault(req.request_id, []).append(time.perf_counter())

    run_cfg = replace(run_cfg, gpu_timeline=True)  # how long the GPU waited for the CPU
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)
    with build_engine(model, run_cfg, run.choice, requests=reqs + warm_reqs,
                      on_token=on_token, ranks=group) as loaded:
        engine, dense = loaded.engine, loaded.config.dense_batch
        warm_graphs = None
        with torch.inference_mode():
            if warm_reqs:
                _drain(engine, warm_reqs, None)
                warm_graphs = engine.stats.graphs.as_dict() if engine.stats.graphs else None
                engine.stats = EngineStats(graphs=engine.graphs.reset_stats()
                                           if engine.graphs else None)
                engine.scheduler.reset_stats()
            token_times.clear()  # the warm-up's
            bar = _progress(len(reqs), progress)
            sent = engine.link.counters() if engine.link is not None else None
            elapsed = _drain(engine, reqs, bar)
            bar.close()
            cache = engine.scheduler.prefix_report()  # the run's, not the forward's after it
            if sent is not None:
                sent = _sent_per_step(sent, engine.link.counters())
            timeline = engine.gpu_timeline_report()
            fwd, n_dec, ctx = engine.run_on_ranks(engine_forward_ms, dense, n_dec, context,
                                                  prompt, run.graphs)
            shapes = shape_report(engine.stats, run.choice.schedule,
                                  engine.forward_ms_by_shape())
        stats, batches = engine.stats, engine.scheduler.report() | {"prefix_cache": cache}
        pages = loaded.config.num_pages
        memory = gpu_memory(model, run_cfg, pages)
        graph_errors = dict(engine.graphs.errors) if engine.graphs else {}
    del engine, loaded  # the KV cache and graphs go before the next run allocates its own
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    out = {"strategy": run.choice.strategy.name, **run.info, "graphs": run.graphs,
           "kv_pages": pages, "iterations": stats.iterations, "fallbacks": stats.fallbacks,
           "pipelined_iterations": stats.pipelined,
           "sequential_iterations": stats.sequential, "no_entry_iterations": stats.fallbacks,
           "shapes": shapes,
           "tokens_per_iteration": stats.tokens / max(1, stats.iterations), **batches,
           "forward_ms_full_batch": fwd, "forward_decode_tokens": n_dec,
           "forward_decode_context": ctx,
           "layer_us_full_batch": fwd * 1e3 / spec.num_layers,
           "results": summarize(reqs, elapsed, run_cfg.tp, spec.num_params(active=True), gemm,
                               token_times)}
    if memory is not None:
        out["gpu_memory"] = memory
    if timeline is not None:  # the compute stream over the timed run's iterations
        out["gpu_timeline"] = timeline
    if sent is not None:
        out["tp_messages"] = sent
    if stats.graphs is not None:
        out["graph_stats"] = stats.graphs.as_dict()
        out["graph_stats_warmup"] = warm_graphs
        out["graph_errors"] = {f"{k[0]} {k[1]}": v for k, v in graph_errors.items()}
    return out


def gpu_memory(model: Any, cfg: EngineConfig, pages: int) -> dict[str, int] | None:
    """What the run's engine held on this GPU against what it was given (None on the CPU):
    the budget (`mem_util` of the GPU), the KV pages' bytes, the reserve kept beside them
    (runtime/loader.py reserve_bytes), torch's peak over the run (weights, KV, buffers, the
    CUDA-graph pool, the sampler) and everything in use at its end, other processes' included."""
    if model.device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(model.device)
    return {"budget_bytes": int(cfg.mem_util * total),
            "kv_bytes": pages * page_bytes(model, cfg.page_size, cfg.kv_dtype),
            "reserve_bytes": reserve_bytes(model, cfg.dense_batch),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(model.device),
            "used_bytes_end": total - free, "total_bytes": total}


def _sent_per_step(before: tuple[int, float, int],
                   after: tuple[int, float, int]) -> dict[str, float]:
    """What rank 0 spent sending the timed run's steps to the other ranks, per step."""
    steps = max(1, after[0] - before[0])
    return {"steps": after[0] - before[0], "host_us_per_step": 1e6 * (after[1] - before[1]) / steps,
            "bytes_per_step": (after[2] - before[2]) / steps}


def _drain(engine: Any, reqs: list[Request], bar: Any) -> float:
    """Add `reqs` and step until every one has finished; returns the wall time in seconds."""
    for r in reqs:
        engine.add_request(r)
    start = time.perf_counter()
    engine.t0 = start
    while engine.has_work:
        done = engine.step()
        if bar is not None:
            bar.update(len(done))
    if engine.is_cuda:
        torch.cuda.synchronize(engine.model.device)
    return time.perf_counter() - start


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=not enabled, file=sys.stderr)
