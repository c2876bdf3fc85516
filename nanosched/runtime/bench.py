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
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from nanosched.errors import ConfigError
from nanosched.models.spec import ModelSpec, load_spec
from nanosched.runtime.preempt import AdmissionConfig
from nanosched.runtime.requests import Request, make_requests, poisson_arrivals
from nanosched.runtime.scheduler import OpScheduler


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
    schedule: str = "sequential"  # sequential | two_batch | a schedule JSON file
    compare: bool = False  # also run Sequential first, on the same requests, in this process
    force: bool = False  # replay a schedule made for another model, tp or GPU
    request_rate: float = float("inf")
    seed: int = 0
    device: str = "auto"
    mem_util: float = 0.85
    page_size: int = 16
    # untimed requests each run serves on its engine before its timed requests (None: 64 on a
    # GPU, 0 on the CPU), so no run pays Triton compilation, allocator growth or graph captures
    # that a later run would reuse: without it a second run of the same work measured 4%
    # faster on H100 and H200
    warmup_prompts: int | None = None
    # CUDA graphs: "auto" (on a GPU, else off), "off" (eager), "on" (a graph per strategy and
    # batch bucket, captured as the buckets first appear: in the warm-up or the run), or "both"
    # (every strategy eager, then with graphs)
    graphs: str = "auto"
    # KV admission and preemption (runtime/batcher.py, runtime/preempt.py)
    admission: str = "use"
    kv_headroom: float = 0.0
    preemption: str = "recompute"
    swap_space_gib: float = 4.0

    def admission_config(self, gemm_tflops: float | None = None) -> AdmissionConfig:
        return AdmissionConfig(policy=self.admission, headroom=self.kv_headroom,
                               preemption=self.preemption, swap_space_gib=self.swap_space_gib,
                               gemm_tflops=gemm_tflops)


def resolve_device(name: str) -> torch.device:
    """The torch device of `--device auto|cpu|cuda` (auto: CUDA when visible)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible")
    return torch.device(name)


def _device(cfg: BenchConfig) -> torch.device:
    return resolve_device(cfg.device)


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
             requests: list[Request] | None) -> int:
    """Pages that fit in the GPU memory left after weights and buffers (CPU: what the
    requests could ever need, at most 1 GiB). Unknown requests (None, a server): all the GPU
    memory left, or on the CPU room for 64 requests of the model's full context."""
    spec = model.spec
    page_bytes = 2 * spec.num_layers * page_size * spec.num_kv_heads * spec.head_dim * \
        model.dtype.itemsize
    peaks = [r.peak_tokens for r in requests] if requests is not None else \
        [spec.max_position_embeddings] * 64
    need = sum(-(-p // page_size) + 1 for p in peaks)
    if model.device.type != "cuda":
        return max(1, min(need, (1 << 30) // page_bytes))
    if requests is None:
        need = 1 << 62
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


def cache_context(ws: Any, num_decode: int, context: int, first_id: int) -> None:
    """Give `num_decode` requests (ids from `first_id`) `context - 1` cached tokens each."""
    for r in range(num_decode if context > 1 else 0):
        ws.kv.plan([(first_id + r, context - 1, False)])


def synthetic_batch(ws: Any, dense: int, num_decode: int, context: int, prompt: int,
                    first_id: int) -> tuple[Any, list[tuple[int, int, bool]], list[int]]:
    """Plan a full batch into `ws`: `num_decode` decode tokens with `context` cached tokens
    each, then prompt chunks of at most `prompt` tokens. Returns (meta, segments, request ids)."""
    cache_context(ws, num_decode, context, first_id)
    return plan_batch(ws, dense, num_decode, prompt, first_id)


def batch_chunks(dense: int, num_decode: int, prompt: int, first_id: int,
                 decode_rows: int | None = None) -> list[tuple[int, int, bool]]:
    """`num_decode` decode tokens, then prompt chunks of at most `prompt` tokens filling the
    batch to `dense` rows; with `decode_rows` the decode tokens take that many rows (a graph
    bucket's padding)."""
    chunks = [(first_id + r, 1, True) for r in range(num_decode)]
    left, p = dense - (num_decode if decode_rows is None else decode_rows), 0
    while left > 0:
        n = min(prompt, left)
        chunks.append((first_id + 10**6 + p, n, False))
        left, p = left - n, p + 1
    return chunks


def plan_batch(ws: Any, dense: int, num_decode: int, prompt: int,
               first_id: int) -> tuple[Any, list[tuple[int, int, bool]], list[int]]:
    """Plan the batch itself (decode requests already cached by `cache_context`)."""
    chunks = batch_chunks(dense, num_decode, prompt, first_id)
    meta = ws.kv.plan(chunks)
    segments, row = [], 0
    for _, n, is_decode in chunks:
        segments.append((row, row + n, is_decode))
        row += n
    ws.token_ids[:dense].random_(0, 1000)
    return meta, segments, [c[0] for c in chunks]


def forward_ms(model: Any, ws: Any, strategy: OpScheduler, device: Any, dense: int,
               num_decode: int, context: int, prompt: int, reps: int = 5, graphs: bool = False
               ) -> tuple[float, int, int]:
    """Median wall time of one forward over a full synthetic batch (synchronised each time),
    in the workspace `ws` of a finished run; decode tokens and their context shrink to what its
    cache holds. With `graphs`, the batch is laid out in its bucket (decode rows rounded up to
    32) and the forward is a CUDA graph's replay, metadata writes included. Returns (ms, decode
    tokens, decode context)."""
    from nanosched.models.bucket import round_up
    from nanosched.runtime.backend import Backend
    from nanosched.runtime.graphs import BucketRunner
    from nanosched.runtime.modelprogram import model_program
    from nanosched.runtime.scheduler import run_program

    page = ws.kv.page_size
    avail = ws.kv.allocator.num_free - (dense - num_decode) // page - 8  # pages for decodes
    num_decode = max(0, min(num_decode, avail))
    context = max(1, min(context, avail // max(1, num_decode) * page - 1))
    runner = BucketRunner(model, ws, Backend(device), strategy, align=32,
                          max_pages=-(-max(context + 1, prompt) // page), capture=True) \
        if graphs else None
    untimed = 2 if graphs else 1  # the first forward compiles; with graphs the second captures
    times = []
    for rep in range(reps + untimed):
        first_id = rep * 10**7
        cache_context(ws, num_decode, context, first_id)
        if runner is None:
            meta, segments, ids = plan_batch(ws, dense, num_decode, prompt, first_id)
            program = model_program(model, ws, meta, segments)
            t0 = time.perf_counter()
            run_program(program, strategy, Backend(device))
        else:
            chunks = batch_chunks(dense, num_decode, prompt, first_id,
                                  decode_rows=round_up(num_decode, runner.align))
            ids = [c[0] for c in chunks]
            seqs = ws.kv.plan_chunks(chunks)
            ws.token_ids[:dense].random_(0, 1000)
            entry = runner.entry(runner.bucket(seqs))
            t0 = time.perf_counter()
            runner.run(entry, seqs)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        if rep >= untimed:
            times.append((time.perf_counter() - t0) * 1e3)
        for r in ids:
            ws.kv.release(r)
    return float(np.median(times)), num_decode, context


@dataclass
class _Run:
    name: str
    strategy: OpScheduler
    device: Any = None
    closer: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    graphs: bool = False


GRAPH_MODES = {"off": (False,), "on": (True,), "both": (False, True)}


def resolve_graphs(mode: str, device: torch.device, allowed: tuple[str, ...]) -> str:
    """`--graphs auto` → on with a GPU, off on the CPU; other modes checked against `allowed`
    (a GPU needed for any but off)."""
    if mode not in ("auto", *allowed):
        raise ConfigError(f"--graphs must be one of auto, {', '.join(allowed)}; got {mode!r}")
    if mode == "auto":
        return "on" if device.type == "cuda" else "off"
    if mode != "off" and device.type != "cuda":
        raise ConfigError(f"--graphs {mode} needs a CUDA GPU (graphs replay CUDA launches); "
                          f"use --graphs off or auto on the CPU")
    return mode


def _with_graphs(runs: list[_Run], mode: str) -> list[_Run]:
    """Each run once per graph mode asked for; graphed runs are named `<name>+graphs`."""
    return [replace(r, name=r.name + ("+graphs" if g else ""), graphs=g)
            for r in runs for g in GRAPH_MODES[mode]]


def _strategies(cfg: BenchConfig, spec: ModelSpec, device: torch.device) -> list[_Run]:
    from nanosched.runtime.strategies import Sequential, TwoBatchOverlap

    runs = [_Run("sequential", Sequential())] if cfg.compare or cfg.schedule == "sequential" \
        else []
    if cfg.schedule == "two_batch":
        sms = torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 132
        runs.append(_Run("two_batch", TwoBatchOverlap(num_sms=sms)))
    elif cfg.schedule != "sequential":
        runs.append(_replay_run(cfg, spec, device))
    return runs


def _replay_run(cfg: BenchConfig, spec: ModelSpec, device: torch.device) -> _Run:
    from nanosched.runtime.strategies.replay import Replay
    from nanosched.schedules.format import check_compatible, load_schedule

    sched = load_schedule(cfg.schedule)
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    forced = check_compatible(sched, spec, cfg.tp, gpu_name, force=cfg.force)
    replay = Replay(sched, spec.num_layers)
    run = _Run("schedule", replay, info={
        "schedule": cfg.schedule, "forced_past": forced, "dense_batch": sched.batch.dense_batch,
        "num_decode": sched.batch.num_decode, "predicted_period_us": sched.prediction.period_us,
        "predicted_tokens_per_s_per_gpu": sched.prediction.tokens_per_s,
        "predicted_speedup": sched.prediction.speedup})
    if device.type == "cuda":
        from nanosched.runtime.streams import ReplayStreams

        streams = ReplayStreams(replay.streams, device.index or 0)
        run.device, run.closer = streams.device, streams
    return run


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Build the model; serve every request with each strategy asked for (the same requests,
    one after another in this process); return the figures as a dict."""
    if cfg.tp != 1:
        raise ConfigError("--tp > 1 is not benchmarked yet: run with --tp 1")
    cfg.admission_config()  # range-check the admission flags before loading anything
    spec = load_spec(cfg.model)
    device = _device(cfg)
    graphs = resolve_graphs(cfg.graphs, device, tuple(GRAPH_MODES))
    runs = _with_graphs(_strategies(cfg, spec, device), graphs)
    dense = cfg.dense_batch or next((r.info["dense_batch"] for r in runs if r.info),
                                    2048 if device.type == "cuda" else 256)
    for r in runs:
        if r.info and r.info["dense_batch"] != dense:
            raise ConfigError(f"--dense-batch {dense} differs from the schedule's "
                              f"{r.info['dense_batch']}: omit it or search for {dense}")
    model = build_model(spec, cfg.weights, device, cfg.seed)
    gemm = measured_gemm_tflops(device)
    out: dict[str, Any] = {"config": asdict(cfg) | {"dense_batch": dense, "graphs": graphs},
                           "environment": environment(device), "model_params": spec.num_params(),
                           "gemm_tflops_8192": gemm, "runs": {}}
    warm = cfg.warmup_prompts if cfg.warmup_prompts is not None else \
        (64 if device.type == "cuda" else 0)
    if warm < 0:
        raise ConfigError(f"--warmup-prompts must be >= 0, got {warm}")
    out["warmup_prompts"] = warm
    try:
        # every run times its full-batch forward on the same batch: the schedule's mix if any
        num_decode = next((r.info["num_decode"] for r in runs if r.info), None)
        for r in runs:
            out["runs"][r.name] = _serve(cfg, spec, model, dense, gemm, r, warm, progress,
                                         num_decode)
    finally:
        for r in runs:
            if r.closer is not None:
                r.closer.close()
    tps = {name: run["results"]["tokens_per_s"] for name, run in out["runs"].items()}

    def ratio(a: str, b: str) -> dict[str, Any]:
        return {"of": f"{a} / {b}", "tokens_per_s": tps[a] / tps[b]}

    # each strategy against Sequential in the same graph mode, then graphs against eager
    seq = {False: "sequential", True: "sequential+graphs"}
    out["ratios"] = {r.name: ratio(r.name, seq[r.graphs]) for r in runs
                     if r.name != seq[r.graphs] and seq[r.graphs] in tps}
    out["ratios"] |= {f"{r.name} vs eager": ratio(r.name, eager) for r in runs
                      if r.graphs and (eager := r.name.removesuffix("+graphs")) in tps}
    if len(runs) == 2 and out["ratios"]:  # the one comparison (kept for older readers)
        out["ratio"] = next(iter(out["ratios"].values()))
    return out


def _serve(cfg: BenchConfig, spec: ModelSpec, model: Any, dense: int, gemm: float | None,
           run: _Run, warm: int, progress: bool, num_decode: int | None) -> dict[str, Any]:
    """Serve `warm` untimed requests, then the timed ones, on one engine (so graphs captured in
    the warm-up are replayed in the run, as a server captures before it serves); then time a
    full-batch forward with `num_decode` decode tokens (a third of the batch when None)."""
    from nanosched.runtime.engine import Engine, EngineStats

    reqs = make_requests(cfg.workload, cfg.input_len, cfg.output_len, cfg.num_prompts,
                         spec.vocab_size, spec.max_position_embeddings, cfg.seed)
    poisson_arrivals(reqs, cfg.request_rate, cfg.seed)
    warm_reqs = make_requests(cfg.workload, cfg.input_len, cfg.output_len, warm,
                              spec.vocab_size, spec.max_position_embeddings, cfg.seed + 1) \
        if warm else []
    pages = kv_pages(model, dense, cfg.page_size, cfg.mem_util, reqs + warm_reqs)
    longest = max(r.peak_tokens for r in reqs + warm_reqs)
    engine = Engine(model, dense_batch=dense, num_pages=pages, page_size=cfg.page_size,
                    strategy=run.strategy, seed=cfg.seed, device=run.device,
                    graphs="on" if run.graphs else "off", max_context=longest,
                    admission=cfg.admission_config(gemm))
    warm_graphs = None
    with torch.inference_mode():
        if warm_reqs:
            _drain(engine, warm_reqs, None)
            warm_graphs = engine.stats.graphs.as_dict() if engine.stats.graphs else None
            engine.stats = EngineStats(graphs=engine.graphs.reset_stats()
                                       if engine.graphs else None)
            engine.batcher.reset_stats()
        bar = _progress(len(reqs), progress)
        elapsed = _drain(engine, reqs, bar)
        bar.close()
        n_dec = num_decode or dense // 3
        prompt = cfg.input_len or 1024
        fwd, n_dec, ctx = forward_ms(model, engine.ws, run.strategy, engine.backend.device,
                                     dense, n_dec, prompt + (cfg.output_len or 512) // 2, prompt,
                                     graphs=run.graphs)
    stats, batches = engine.stats, engine.batcher.report()
    graph_errors = dict(engine.graphs.errors) if engine.graphs else {}
    del engine
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    out = {"strategy": run.strategy.name, **run.info, "graphs": run.graphs, "kv_pages": pages,
           "iterations": stats.iterations, "fallbacks": stats.fallbacks,
           "tokens_per_iteration": stats.tokens / max(1, stats.iterations), **batches,
           "forward_ms_full_batch": fwd, "forward_decode_tokens": n_dec,
           "forward_decode_context": ctx,
           "layer_us_full_batch": fwd * 1e3 / spec.num_layers,
           "results": summarize(reqs, elapsed, cfg.tp, spec.num_params(active=True), gemm)}
    if stats.graphs is not None:
        out["graph_stats"] = stats.graphs.as_dict()
        out["graph_stats_warmup"] = warm_graphs
        out["graph_errors"] = {f"{k[0]} {k[1]}": v for k, v in graph_errors.items()}
    return out


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
