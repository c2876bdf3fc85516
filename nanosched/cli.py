"""The `nanosched` command line: each command parses flags into a config and calls one function.

Errors that name a bad input (`NanoschedError`) print one line to stderr and exit with code 2,
as typer's own usage errors do.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import typer

from nanosched.errors import ConfigError, NanoschedError

app = typer.Typer(
    name="nanosched",
    help=(
        "Find and run nano-batch pipelines for LLM inference: profile a GPU's kernels and their "
        "interference, search the pipeline with OR-Tools, and replay it when serving.\n\n"
        "Start with `nanosched analyze --model llama3-70b --gpu h100 --tp 8` to see where an "
        "iteration's time goes."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

F = TypeVar("F", bound=Callable[..., Any])


def _version(value: bool) -> None:
    if value:
        from nanosched import __version__

        typer.echo(f"nanosched {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Find and run nano-batch pipelines for LLM inference."""


def reports_errors(fn: F) -> F:
    """Turn a NanoschedError into `error: ...` on stderr and exit code 2; an OSError (a file
    that cannot be read or written) into `error: FILE: why`, exit code 1: no traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NanoschedError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=2) from None
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            typer.echo(f"error: {where}{exc.strerror or exc}", err=True)
            raise typer.Exit(code=1) from None

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM raises KeyboardInterrupt as Ctrl-C does, so `search` and `profile` stop
    the same way for both: a clear message, an earlier output file untouched, exit 130."""
    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def require_matplotlib(flag: str = "--plot") -> None:
    """Refuse `flag` before any work when matplotlib is missing, naming the extra."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(f"{flag} needs matplotlib: pip install -e '.[plot]' (or "
                          f"pip install matplotlib)") from None


DEFAULT_GPU = "h100"  # the prior assumed with no --gpu and no GPU present


def gpu_here() -> str | None:
    """The prior name (hardware.GPUS) of the CUDA device present, None without one (or when
    torch knows no prior for it)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name(0)
    except Exception:  # no torch, no driver: no GPU to default to
        return None
    from nanosched.hardware import prior_for

    prior = prior_for(name)
    if prior is None:
        typer.echo(f"note: no prior for {name}; pass --gpu", err=True)
    return prior.name if prior is not None else None


def default_gpu(gpu: str | None, assume: bool = True) -> str | None:
    """`--gpu` as given, else the GPU present, else (with `assume`) DEFAULT_GPU, said on
    stderr; without `assume` None is returned for the command to decide."""
    if gpu is not None:
        return gpu
    here = gpu_here()
    if here is not None:
        typer.echo(f"--gpu not given: using {here}, the GPU present", err=True)
        return here
    if assume:
        typer.echo(f"--gpu not given and no GPU here: assuming {DEFAULT_GPU}", err=True)
        return DEFAULT_GPU
    return None


def check_flag(flag: str, value: Any, ok: bool, allowed: str) -> None:
    """Raise ConfigError `FLAG must be ALLOWED, got VALUE` unless `ok`."""
    if not ok:
        raise ConfigError(f"{flag} must be {allowed}, got {value}")


def print_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    """Print rows as an aligned text table; columns are (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([format(row[k], f) if isinstance(row.get(k), (int, float)) and f
                      else str(row.get(k, "-")) for k, _, f in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for n, r in enumerate(cells):
        typer.echo("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if n == 0:
            typer.echo("  ".join("-" * w for w in widths))


@app.command()
@reports_errors
def models(
    gpu: str | None = typer.Option(None, "--gpu", help="GPU the 'tp' column is sized for "
                                   "(default: the GPU present, else h100)."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """List the registered models: size, memory, and the tp that fits on --gpu.

    Any of these names works wherever --model is asked for (random weights unless a checkpoint
    folder is given instead); `smollm2-135m` and `qwen2.5-0.5b` run in seconds on a CPU.
    """
    from nanosched.models.spec import registry_rows

    gpu = default_gpu(gpu)
    rows = registry_rows(gpu)
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    print_table(rows, [("name", "model", ""), ("arch", "arch", ""),
                       ("params_b", "params (B)", ".3f"), ("bf16_gib", "bf16 GiB", ".1f"),
                       ("fp32_gib", "fp32 GiB", ".1f"), ("kv_kib_per_token", "KV KiB/token", ".0f"),
                       ("tp", f"tp on {gpu}", "")])
    typer.echo("GiB: the weights alone; tp: the smallest whose GPUs hold the weights and the KV "
               "cache of a 1,024-token dense batch at 1024 / 512 (nanosched analyze)")


@app.command()
@reports_errors
def analyze(
    model: str = typer.Option(..., "--model", "-m",
                              help="Model name (e.g. llama3-70b) or an HF config.json / folder."),
    gpu: str | None = typer.Option(None, "--gpu", help="GPU prior from NanoFlow's Table 1 "
                                   "(a100, a100-40g, h100, h200, b200, mi300, ...); default: "
                                   "the GPU present, else h100."),
    tp: int | None = typer.Option(None, "--tp", help="Tensor-parallel degree (number of GPUs); "
                                  "default: the smallest whose GPUs hold the weights and the KV "
                                  "cache of the dense batch (--dense-batch, else 1024 tokens)."),
    dense_batch: int | None = typer.Option(
        None, "--dense-batch", help="Tokens per iteration; default: the largest that fits, "
        "capped at 2048."),
    input_len: float | None = typer.Option(None, "--input-len", help="Mean prompt tokens p "
                                           "(default 1024 with --output-len 512)."),
    output_len: float | None = typer.Option(None, "--output-len", help="Mean output tokens d."),
    workload: str | None = typer.Option(None, "--workload", help="Named dataset instead of "
                                        "lengths: sharegpt, lmsys, splitwise."),
    compute_tflops: float | None = typer.Option(
        None, "--compute-tflops", help="Measured dense bf16 TFLOP/s per GPU to use instead of "
        "the prior."),
    mem_util: float = typer.Option(0.9, "--mem-util", help="Share of GPU memory for weights, "
                                   "KV cache and activations."),
    as_json: bool = typer.Option(False, "--json", help="Print the analysis as JSON."),
) -> None:
    """Estimate per-op compute, memory and network time of one iteration (NanoFlow Table 2).

    Prints FLOPs, bytes and time per resource for every op over all layers, the bottleneck,
    the largest dense batch that fits, T_R (Eq. 4) and the optimal throughput (Eq. 5).
    """
    from nanosched.costmodel import analyze as run_analysis
    from nanosched.costmodel import choose_tp
    from nanosched.hardware import get_gpu
    from nanosched.models.spec import load_spec
    from nanosched.workloads import resolve_workload

    check_flag("--mem-util", mem_util, 0 < mem_util <= 1, "in (0, 1] (a share of GPU memory)")
    check_flag("--tp", tp, tp is None or tp >= 1, "a positive integer")
    check_flag("--dense-batch", dense_batch, dense_batch is None or dense_batch >= 1,
               "a positive number of tokens")
    spec = load_spec(model)
    gpu = default_gpu(gpu)
    gpu_spec = get_gpu(gpu).with_measured(compute_tflops=compute_tflops)
    wl = resolve_workload(workload, input_len, output_len)
    if tp is None:
        target = dense_batch or TP_FIT_BATCH
        tp = choose_tp(spec, gpu_spec, wl, target, mem_util)
        typer.echo(f"--tp not given: using tp={tp}, the smallest whose {gpu_spec.name} GPUs hold "
                   f"the weights and the KV cache of a {target}-token dense batch", err=True)
    result = run_analysis(spec, gpu_spec, tp, wl, dense_batch, mem_util)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
        return
    _print_analysis(result)


TP_FIT_BATCH = 1024  # the batch `analyze` and `models` size the smallest tp for, as the search


def _print_analysis(a: Any) -> None:
    mix = a.mix
    typer.echo(f"{a.model.name} on {a.tp} x {a.gpu.name} ({a.gpu.compute_gflops / 1e3:g} TFLOP/s, "
               f"{a.gpu.mem_bw_gbs:g} GB/s, {a.gpu.net_bw_gbs:g} GB/s link; {a.gpu.source})")
    typer.echo(f"workload {a.workload.name}: p={a.workload.input_len:g}, "
               f"d={a.workload.output_len:g}; dense batch {mix.dense_batch} = "
               f"{mix.num_decode:.0f} decode (context {mix.decode_context:g}) + "
               f"{mix.num_prefill:.0f} prefill tokens")
    typer.echo("")
    rows = [{"op": o.name, "class": o.resource, "gflop": o.flops / 1e9, "gb": o.mem_bytes / 1e9,
             "net": o.net_bytes / 1e9, "tc": o.t_compute_s * 1e3, "tm": o.t_mem_s * 1e3,
             "tn": o.t_net_s * 1e3, "bound": o.bottleneck} for o in a.ops]
    rows.append({"op": "total", "class": "", "gflop": a.total("flops") / 1e9,
                 "gb": a.total("mem_bytes") / 1e9, "net": a.total("net_bytes") / 1e9,
                 "tc": a.total("t_compute_s") * 1e3, "tm": a.total("t_mem_s") * 1e3,
                 "tn": a.total("t_net_s") * 1e3, "bound": a.bottleneck})
    print_table(rows, [("op", "op", ""), ("class", "class", ""), ("gflop", "GFLOP", ".1f"),
                       ("gb", "mem GB", ".2f"), ("net", "net GB", ".2f"),
                       ("tc", "T_comp ms", ".2f"), ("tm", "T_mem ms", ".2f"),
                       ("tn", "T_net ms", ".2f"), ("bound", "bottleneck", "")])
    typer.echo("")
    params = a.model.num_params(active=True)
    typer.echo(f"parameters used per token: {params / 1e9:.2f} B; "
               f"largest dense batch that fits: {a.max_dense_batch}")
    typer.echo(f"T_R = T_mem / T_compute (Eq. 4): {a.t_r:.3f} "
               f"({'compute' if a.t_r < 1 else 'memory'}-bound)")
    seq = a.sequential_iteration_s
    typer.echo(f"sequential iteration (each op at its bottleneck): {seq * 1e3:.2f} ms = "
               f"{mix.dense_batch / seq / a.tp:.0f} tokens/s/GPU")
    typer.echo(f"optimal throughput (Eq. 5): {a.optimal_tokens_per_s_per_gpu:.0f} tokens/s/GPU")


KV_DTYPE_HELP = ("KV cache element type, as vLLM's flag: 'auto' (the model's dtype) or 'fp8' "
                 "(e4m3 with one scale per token and KV head: about half the bytes, so twice "
                 "the tokens fit and the decode attention reads half as much).")
DECODE_ATTENTION_HELP = ("Decode attention kernel where a schedule names none: 'auto' "
                         "(cuda_bulk on an FP8 cache where it can run: a Hopper GPU with cupy "
                         "and cuda-bindings; else triton_pipelined), or triton_pipelined, "
                         "triton_pipelined_2w, triton_paged (on a CPU without Triton: the torch "
                         "reference).")


def kernel_options(decode_attention: str) -> Any:
    """The engine's KernelOptions for --decode-attention, refused with the flag's name."""
    from nanosched.kernels import impls
    from nanosched.kernels.dispatch import KernelOptions

    if decode_attention not in impls.DECODE_OPTIONS:
        raise ConfigError(f"--decode-attention must be one of {', '.join(impls.DECODE_OPTIONS)}; "
                          f"got {decode_attention!r}")
    return KernelOptions(decode_impl=decode_attention)


@app.command()
@reports_errors
def generate(
    model: str = typer.Option(..., "--model", "-m", help="Registered model name (random "
                              "weights) or an HF checkpoint folder (config.json + safetensors)."),
    prompt: str | None = typer.Option(None, "--prompt", help="Prompt text (needs a tokenizer "
                                      "in the checkpoint folder)."),
    prompt_ids: str | None = typer.Option(None, "--prompt-ids", help="Prompt token ids, "
                                          "comma-separated: 1,2,3."),
    max_tokens: int = typer.Option(32, "--max-tokens", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree (processes)."),
    seed: int = typer.Option(0, "--seed", help="Seed of random weights and of sampling."),
    as_json: bool = typer.Option(False, "--json", help="Print prompt and output ids as JSON."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help=KV_DTYPE_HELP),
    decode_attention: str = typer.Option("auto", "--decode-attention",
                                         help=DECODE_ATTENTION_HELP),
) -> None:
    """Generate a continuation: the prompt served as one request by the engine."""
    from nanosched.errors import ConfigError
    from nanosched.runtime.config import EngineConfig
    from nanosched.runtime.generate import GenerateConfig
    from nanosched.runtime.generate import generate as run_generate

    ids = None
    if prompt_ids is not None:
        try:
            ids = tuple(int(t) for t in prompt_ids.split(","))
        except ValueError:
            raise ConfigError(f"--prompt-ids must be comma-separated integers, got "
                              f"{prompt_ids!r}") from None
    engine = EngineConfig(model=model, device=device, tp=tp, seed=seed, kv_dtype=kv_cache_dtype,
                          kernels=kernel_options(decode_attention))
    cfg = GenerateConfig(engine, prompt=prompt, prompt_ids=ids, max_tokens=max_tokens,
                         temperature=temperature)
    result = run_generate(cfg)
    if result.random_weights:
        typer.echo(f"note: {model} has no checkpoint here; using random weights (seed {seed})",
                   err=True)
    if as_json:
        typer.echo(json.dumps({"model": model, "prompt_ids": result.prompt_ids,
                               "output_ids": result.output_ids, "text": result.text}))
    else:
        typer.echo(result.text if result.text is not None
                   else " ".join(map(str, result.output_ids)))


def _print_run(name: str, run: dict[str, Any]) -> None:
    """A run's counters under the results table: iterations (pipelined, sequential by the
    strategy's decision, no entry), batches, preemptions, graphs, the full-batch forward and
    the most-run batch shapes (ms throughout)."""
    p = run["preemptions"]
    typer.echo(f"[{name}] strategy {run['strategy']}: {run['iterations']} iterations "
               f"({run['pipelined_iterations']} pipelined, {run['sequential_iterations']} "
               f"sequential by the strategy's decision, {run['no_entry_iterations']} with no "
               f"entry: fallback), {run['tokens_per_iteration']:.1f} tokens per iteration, "
               f"{100 * run['full_batch_share']:.1f}% at the dense batch; admission "
               f"{run['admission']}: {p['preemptions']} preemptions ({p['recomputed']} "
               f"recomputed, {p['swapped']} swapped)")
    if "gpu_timeline" in run:
        t, wall = run["gpu_timeline"], run["results"]["elapsed_s"]
        typer.echo(f"  GPU: {t['busy_s']:.1f} s on {t['iterations']} iterations' work, "
                   f"{t['idle_s']:.1f} s between them waiting for the CPU "
                   f"({100 * t['idle_s'] / wall:.0f}% of the {wall:.1f} s run)")
    if "graph_stats" in run:
        g = run["graph_stats"]
        typer.echo(f"  CUDA graphs: {g['replays']} replays, {g['captures']} captures "
                   f"({g['capture_s']:.1f} s) over {g['buckets']} buckets, "
                   f"{g['eager_bucket'] + g['unbucketed']} eager iterations, "
                   f"{g['padded_rows']} padded rows")
        for key, err in run.get("graph_errors", {}).items():
            typer.echo(f"  graph capture failed for {key}: {err}")
    line = f"  full-batch forward ({'graph' if run.get('graphs') else 'eager'}) " \
           f"{run['forward_ms_full_batch']:.2f} ms = " \
           f"{run['layer_us_full_batch'] / 1e3:.3f} ms per layer"
    if "predicted_period_us" in run:
        line += f" (schedule predicted {run['predicted_period_us'] / 1e3:.3f} ms)"
    typer.echo(line)
    for row in run.get("shapes", []):
        if "forward_ms" not in row and "entry" not in row:
            continue
        text = f"  shape D={row['num_decode']} T={row['num_tokens']}: {row['iterations']} " \
               f"iterations"
        if "entry" in row:
            text += f", entry {row['entry']}"
            if row["entry"] != "none":
                text += f" (key {row['key'][0]},{row['key'][1]})"
                if row.get("predicted_forward_ms") is not None:
                    text += f", predicted {row['predicted_forward_ms']:.2f} ms"
        if "forward_ms" in row:
            text += f", measured {row['forward_ms']:.2f} ms (median of the run's " \
                    f"{row['forward_iterations']} forwards there)"
        typer.echo(text)


ADMISSION_HELP = (
    "KV admission: 'use' (default, as vLLM and SGLang: admit while the request's prompt pages "
    "plus --kv-headroom are free; when a decode lacks a page, preempt the most recently "
    "admitted requests), 'reserve' (admit only if the peak with every request at max_tokens "
    "fits; never preempts, holds back when requests stop early), or 'predict' (NanoFlow: that "
    "peak with outputs predicted from requests that ended; preempts when short).")
HEADROOM_HELP = ("Share of the KV cache, in [0, 1), left free after admitting a request under "
                 "'use' or 'predict' (waived when nothing else runs): fewer preemptions, fewer "
                 "requests at once.")
PREEMPTION_HELP = (
    "How a preempted request gives up its KV pages: 'recompute' (default: dropped; it prefills "
    "prompt + outputs again, no token is sampled twice), 'swap' (copied to host memory and "
    "back before it runs again; recompute when --swap-space is full), or 'auto' (swap when "
    "copying out and in over the host link costs less than recomputing at the GEMM peak).")
SWAP_HELP = "Host memory in GiB, in [0, 1048576], for swapped-out KV (pinned on a GPU)."


@app.command()
@reports_errors
def bench(
    model: str = typer.Option(..., "--model", "-m", help="Model name or HF checkpoint folder."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree."),
    weights: str | None = typer.Option(None, "--weights", help="'random' (seeded) or a local "
                                       "HF checkpoint folder (default: the --model folder's "
                                       "weights, else random, as serve)."),
    input_len: int | None = typer.Option(None, "--input-len", help="Prompt tokens per request "
                                         "(with --output-len)."),
    output_len: int | None = typer.Option(None, "--output-len", help="Output tokens per "
                                          "request."),
    workload: str | None = typer.Option(None, "--workload", help="sharegpt, lmsys, splitwise "
                                        "(NanoFlow Table 4 statistics) or a JSONL file."),
    num_prompts: int = typer.Option(100, "--num-prompts", help="Number of requests."),
    dense_batch: int | None = typer.Option(None, "--dense-batch", help="Tokens per iteration "
                                           "(default 2048 on a GPU, 256 on the CPU)."),
    schedule: str = typer.Option("sequential", "--schedule", help="'sequential', "
                                 "'two_batch' (TokenWeave-style overlap), 'auto' (a matching "
                                 "shipped schedule, else Sequential) or a schedule JSON file "
                                 "from `nanosched search`."),
    compare: bool = typer.Option(False, "--compare", help="Run Sequential first on the same "
                                 "requests in this process and report the ratio."),
    force: bool = typer.Option(False, "--force", help="Replay a schedule made for another "
                               "model, tp or GPU."),
    request_rate: float = typer.Option(float("inf"), "--request-rate", help="Poisson arrivals "
                                       "per second (default: all at once, offline)."),
    seed: int = typer.Option(0, "--seed", help="Seed of lengths, token ids, arrivals, weights."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    warmup_prompts: int | None = typer.Option(None, "--warmup-prompts", help="Untimed requests "
                                              "served with every strategy first, so no run "
                                              "pays compilation a later one reuses (default: "
                                              "64 on a GPU, 0 on the CPU)."),
    graphs: str = typer.Option("auto", "--graphs", help="CUDA graphs: 'auto' (on with a GPU, "
                               "else off), 'off' (eager launches), 'on' (one graph per "
                               "strategy and batch bucket, captured when a bucket first "
                               "appears), or 'both' (every strategy eager, then with graphs)."),
    json_out: str | None = typer.Option(None, "--json", help="Write every figure, the "
                                        "configuration and the environment to this file."),
    admission: str = typer.Option("use", "--admission", help=ADMISSION_HELP),
    kv_headroom: float = typer.Option(0.0, "--kv-headroom", help=HEADROOM_HELP),
    preemption: str = typer.Option("recompute", "--preemption", help=PREEMPTION_HELP),
    swap_space: float = typer.Option(4.0, "--swap-space", help=SWAP_HELP),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help=KV_DTYPE_HELP),
    decode_attention: str = typer.Option("auto", "--decode-attention",
                                         help=DECODE_ATTENTION_HELP),
) -> None:
    """Serve a workload with the engine and report throughput and latency (NanoFlow §6).

    Flag names follow `vllm bench throughput`. Benchmark mode ignores EOS and generates each
    request's given output length.
    """
    from nanosched.benchmarks.throughput import BenchConfig, run_bench
    from nanosched.fileio import check_output_file, finite_json, write_json_atomic
    from nanosched.runtime.config import EngineConfig
    from nanosched.runtime.preempt import AdmissionConfig

    if json_out:
        check_output_file(json_out, "--json")
    admit = AdmissionConfig(policy=admission, headroom=kv_headroom, preemption=preemption,
                            swap_space_gib=swap_space)
    engine = EngineConfig(model=model, tp=tp, weights=weights, device=device, seed=seed,
                          schedule=schedule, force=force, dense_batch=dense_batch,
                          graphs=graphs, admission=admit, kv_dtype=kv_cache_dtype,
                          kernels=kernel_options(decode_attention))
    cfg = BenchConfig(engine, input_len=input_len, output_len=output_len, workload=workload,
                      num_prompts=num_prompts, compare=compare, request_rate=request_rate,
                      warmup_prompts=warmup_prompts)
    out = run_bench(cfg)
    from nanosched.benchmarks.report import results_table

    env, conf = out["environment"], out["config"]
    weights_used = "random weights" if conf["weights"] == "random" else conf["weights"]
    typer.echo(f"{env['device']}: {model} tp={tp}, dense batch {conf['dense_batch']}, "
               f"{weights_used}" + (f" (seed {seed})" if conf["weights"] == "random" else ""))
    for line in results_table({name: run["results"] for name, run in out["runs"].items()}):
        typer.echo(line)
    optimal = next(iter(out["runs"].values()))["results"].get("optimal_tokens_per_s_per_gpu")
    if optimal:
        typer.echo(f"optimal: {optimal:,.0f} tokens/s per GPU = GEMM peak "
                   f"{out['gemm_tflops_8192']:.0f} TFLOP/s (8192^3, 50 ms from an idle GPU) / "
                   f"(2 x active parameters)")
    for name, run in out["runs"].items():
        _print_run(name, run)
    for ratio in out["ratios"].values():
        typer.echo(f"ratio {ratio['of']}: {ratio['tokens_per_s']:.3f}x tokens/s "
                   f"(same requests, same process)")
        if ratio["warnings"]:
            typer.echo(f"warning: ratio {ratio['of']} may be noise: "
                       f"{'; '.join(ratio['warnings'])}. Serve more or longer requests "
                       f"(--num-prompts, --output-len)", err=True)
    if json_out:
        write_json_atomic(json_out, finite_json(out))
        typer.echo(f"wrote {json_out}")


profile_app = typer.Typer(
    help="Measure this GPU's kernels and their interference (`nanosched profile --gpu 0 "
    "--model llama3-8b`), or show a profile (`nanosched profile show FILE`).",
    no_args_is_help=False, add_completion=False, pretty_exceptions_enable=False)
app.add_typer(profile_app, name="profile")


@profile_app.callback(invoke_without_command=True)
@reports_errors
def profile(
    ctx: typer.Context,
    gpu: int = typer.Option(0, "--gpu", help="CUDA device index to measure."),
    model: str | None = typer.Option(None, "--model", "-m", help="Model name or HF config."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree: kernels are measured at "
                           "tp-sharded shapes; network rows on min(tp, visible GPUs)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Profile file to write "
                                    "(default profile-MODEL-tpN.json)."),
    quick: bool = typer.Option(False, "--quick", help="Coarse grid: fewer SM partitions, "
                               "implementations, contexts and pairs (about 2 minutes)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT.partial.json."),
    dense_batch: int | None = typer.Option(None, "--dense-batch", help="Largest token count "
                                           "(default: what fits, capped at 2048)."),
    input_len: float | None = typer.Option(None, "--input-len", help="Mean prompt tokens p."),
    output_len: float | None = typer.Option(None, "--output-len", help="Mean output tokens d."),
    workload: str | None = typer.Option(None, "--workload", help="sharegpt, lmsys, splitwise."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
    fake_gpu: bool = typer.Option(False, "--fake-gpu", help="Dry run on a simulated GPU "
                                  "(deterministic numbers, no CUDA needed)."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="KV cache the attention "
                                       "and rope_append rows run on: 'auto' (the model's dtype) "
                                       "or 'fp8'. A schedule searched on the profile runs only "
                                       "on that cache (serve/bench --kv-cache-dtype)."),
) -> None:
    """Profile kernels alone and in pairs on a GPU and write the profile (nanosched.profile/1).

    Measures ceilings, then every op of the model's layer at 128..dense-batch tokens on every
    SM partition and implementation, then compute x memory (and x network, tp > 1) pairs, and
    derives the R->P tables. Ctrl-C leaves OUT.partial.json; --resume continues it.
    """
    if ctx.invoked_subcommand is not None:
        return
    from nanosched.profiler.command import ProfileConfig, profile_gpu
    from nanosched.profiler.runner import ProfileInterrupted
    from nanosched.workloads import resolve_workload

    if model is None:
        raise ConfigError("nanosched profile needs --model (e.g. --model llama3-8b)")
    cfg = ProfileConfig(gpu, model, tp, resolve_workload(workload, input_len, output_len), out,
                        quick, resume, dense_batch, not no_progress, fake_gpu,
                        kv_dtype=kv_cache_dtype)
    try:
        with sigterm_as_interrupt():
            profile_gpu(cfg, log=typer.echo)
    except ProfileInterrupted as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(code=130) from None


@profile_app.command("show")
@reports_errors
def profile_show(
    file: Path = typer.Argument(..., help="Profile JSON to show."),
    plot: Path | None = typer.Option(None, "--plot", help="Also write R->P curves and kernel "
                                     "time vs SMs to this .png, .svg or .pdf (needs the "
                                     "[plot] extra: matplotlib)."),
) -> None:
    """Print a profile's ceilings, kernel tables, R->P tables and notes."""
    from nanosched.fileio import PLOT_SUFFIXES, check_input_file, check_output_file
    from nanosched.profiler.format import load_profile
    from nanosched.profiler.show import plot_profile, show_profile

    check_input_file(file, "profile")
    if plot is not None:
        check_output_file(plot, "--plot", PLOT_SUFFIXES)
        require_matplotlib()
    prof = load_profile(file)
    show_profile(prof, echo=typer.echo)
    if plot is not None:
        typer.echo(f"wrote {plot_profile(prof, plot)}")


@profile_app.command("forward")
@reports_errors
def profile_forward(
    file: Path = typer.Argument(..., help="Profile JSON to measure the forward table of."),
    gpu: int = typer.Option(0, "--gpu", help="CUDA device index (the GPU the profile was "
                            "measured on)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Profile to write (default: "
                                    "FILE, replaced atomically)."),
    input_len: float | None = typer.Option(None, "--input-len", help="Mean prompt tokens p "
                                           "the profile was measured for (default 1024)."),
    output_len: float | None = typer.Option(None, "--output-len", help="Mean output tokens d "
                                            "(default 512)."),
    workload: str | None = typer.Option(None, "--workload", help="sharegpt, lmsys, splitwise."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
    fake_gpu: bool = typer.Option(False, "--fake-gpu", help="Dry run on a simulated GPU."),
) -> None:
    """Measure the forward table of a finished profile (a few seconds) and add it.

    A Sequential layer of the profile's fastest kernels on all SMs is looped at the workload's
    mix at half the dense batch and at the dense batch, and decode only at a quarter of it (the
    tail of a run), until the SM clock settles under the power cap, and each op's time inside
    it is set beside its row. The search multiplies a
    row by that factor for an op alone on the whole GPU inside a forward. `nanosched profile`
    measures the table itself; this adds it to a profile taken before it did. Sets searched on
    the old file name its digest: search them again."""
    from nanosched.profiler.command import add_forward
    from nanosched.workloads import resolve_workload

    add_forward(file, gpu, resolve_workload(workload, input_len, output_len), out, fake_gpu,
                not no_progress, log=typer.echo)


@profile_app.command("rederive")
@reports_errors
def profile_rederive(
    file: Path = typer.Argument(..., help="Profile JSON to derive again."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Profile to write (default: "
                                    "FILE, replaced atomically)."),
) -> None:
    """Derive a profile's R->P tables again from its measured pairs and kernel rows (no GPU).

    R->P points give each kernel's P against the profile's own row of that kernel alone, so
    that the search's row / P is the time the kernel took in the pair. Profiles taken before
    this rule gave P against the pair's own alone time, which for a GEMM under the power cap is
    12-15% slower than its row: their pipelines were predicted that much too fast."""
    from nanosched.fileio import check_input_file, check_output_file
    from nanosched.profiler.build import rederive_rp
    from nanosched.profiler.format import load_profile, save_profile

    check_input_file(file, "profile")
    target = out or file
    check_output_file(target, "--out")
    prof = load_profile(file)
    fresh = rederive_rp(prof)
    save_profile(fresh, target)
    typer.echo(f"R->P tables derived again from {len(prof.pairs)} pairs "
               f"({'changed' if fresh != prof else 'unchanged'}); wrote {target}")


@app.command()
@reports_errors
def search(
    model: str = typer.Option(..., "--model", "-m", help="Model name or HF config.json."),
    tp: int | None = typer.Option(None, "--tp", help="Tensor-parallel degree; default: the "
                                  "profile's, or the smallest that fits the dense batch."),
    profile: str | None = typer.Option(None, "--profile", help="Profile FILE or shipped NAME; "
                                       "default: the closest shipped one, else synthetic."),
    gpu: str | None = typer.Option(None, "--gpu", help="GPU for a synthetic profile and the "
                                   "memory fit; a shipped profile is picked only for it "
                                   "(default: the GPU present, else h100, said)."),
    input_len: float | None = typer.Option(None, "--input-len", help="Mean prompt tokens p."),
    output_len: float | None = typer.Option(None, "--output-len", help="Mean output tokens d."),
    workload: str | None = typer.Option(None, "--workload", help="sharegpt, lmsys, splitwise."),
    dense_batch: str = typer.Option("auto", "--dense-batch", help="Tokens per iteration "
                                    "(multiple of 128) or 'auto'."),
    time_limit: float | None = typer.Option(None, "--time-limit", help="Solver seconds for the "
                                            "whole search (default 240 for every batch shape, "
                                            "60 with --buckets dense)."),
    buckets: str = typer.Option("all", "--buckets", help="'all': an entry for every batch "
                                "shape the engine runs (D decode of T rows, multiples of 128 "
                                "up to the dense batch), so ramp and tail batches have one "
                                "too; 'dense': only the steady state's full batch."),
    min_gain: float | None = typer.Option(None, "--min-gain", help="Keep a pipeline only where "
                                          "it predicts at least this gain over Sequential "
                                          "(default 1.05); elsewhere the set says sequential."),
    workers: int = typer.Option(2, "--workers", help="CP-SAT worker threads."),
    max_nano_ops: int = typer.Option(4, "--max-nano-ops", help="Most nano-ops per op."),
    max_period_us: float | None = typer.Option(None, "--max-period-us", help="Refuse layer "
                                               "periods above this."),
    out: str | None = typer.Option(None, "--out", "-o", help="Schedule file to write."),
    allow_unsettled: bool = typer.Option(
        False, "--allow-unsettled", help="Search on a profile whose co-run pairs were timed in "
        "bursts, before the SM clock settled under the power cap (refused by default: its "
        "R->P points overstate overlap)."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="KV cache the schedule "
                                       "will run on: picks (or checks) a profile measured on "
                                       "it ('auto' = the model's dtype, 'fp8')."),
) -> None:
    """Search nano-batch pipelines (two-stage CP-SAT) and write them as a schedule set.

    Each batch shape (D decode rows of T rows) gets an entry: a searched pipeline where it
    predicts at least --min-gain over Sequential, else 'sequential' with the reason (a bound
    shows no schedule can gain there, or the best one found does not). The pipeline table is
    the steady state's: stream, issue order (#), layer offset k (the nano-op of layer l - k is
    issued in period l), tokens, predicted start and duration, share R of the GPU and the
    performance P it keeps there, the allocation (mechanism:SMs or CTAs) and dependencies.
    Ctrl-C or SIGTERM stops the search and writes nothing (exit 130)."""
    from nanosched.autosearch.search import search_and_save

    try:
        with sigterm_as_interrupt():
            search_and_save(model=model, tp=tp, profile=profile,
                            gpu=default_gpu(gpu, assume=False), workload=workload,
                            input_len=input_len, output_len=output_len,
                            dense_batch=dense_batch, time_limit=time_limit,
                            workers=workers, max_nano_ops=max_nano_ops,
                            max_period_us=max_period_us, out=out, echo=typer.echo,
                            print_table=print_table,
                            command=" ".join(["nanosched", *sys.argv[1:]]),
                            allow_unsettled=allow_unsettled, kv_dtype=kv_cache_dtype,
                            buckets=buckets, min_gain=min_gain)
    except KeyboardInterrupt:
        typer.echo("search interrupted: no schedule written (an earlier file is untouched)",
                   err=True)
        raise typer.Exit(code=130) from None


@app.command()
@reports_errors
def verify(
    file: str = typer.Argument(..., help="Schedule set written by `nanosched search`."),
    out: str = typer.Option(..., "--out", "-o", help="Verified set to write (may be FILE)."),
    device: str = typer.Option("auto", "--device", help="auto, cuda or cpu (cpu: a dry run "
                               "of the logic; its times mean nothing)."),
    settle: float = typer.Option(1.0, "--settle", help="Seconds each strategy replays untimed "
                                 "first, so the SM clock settles under the power cap."),
    window: float = typer.Option(2.0, "--window", help="Seconds each strategy is timed."),
    rounds: int = typer.Option(3, "--rounds", help="Times Sequential and the pipeline "
                               "alternate (the median of each is kept)."),
) -> None:
    """Time each pipeline of a schedule set against Sequential on this GPU (CUDA graphs, the
    clock settled under the power cap) and write the set with every pipeline that does not
    reach the set's --min-gain made sequential; each checked entry records the times, SM clock
    and board power. The table sets each measured time beside its prediction (at the context
    the key was searched at: a key timed at a shorter one, where its decode rows do not fit,
    says so in the context column)."""
    from nanosched.benchmarks.verify import VerifyConfig, run_verify

    _, rows = run_verify(file, out, device, VerifyConfig(settle, window, rounds), typer.echo)
    if rows:
        print_table(rows, [("num_decode", "D", ""), ("num_tokens", "T", ""),
                           ("predicted_gain", "predicted", ".3f"),
                           ("sequential_ms", "sequential ms", ".2f"),
                           ("predicted_sequential_ms", "(predicted)", ".2f"),
                           ("pipeline_ms", "pipeline ms", ".2f"),
                           ("predicted_pipeline_ms", "(predicted)", ".2f"),
                           ("gain", "measured", ".3f"),
                           ("decode_context", "context", ""),
                           ("kept", "kept", "")])
    typer.echo(f"verified set written to {out}")


@app.command()
@reports_errors
def show(
    file: str = typer.Argument(..., help="Schedule JSON written by `nanosched search` (a set, "
                               "or a single schedule)."),
    key: str | None = typer.Option(None, "--key", help="D,T: show the pipeline of that entry "
                                   "of a set (default: the table of every entry)."),
    plot: str | None = typer.Option(None, "--plot", help="Also draw a Gantt chart to this "
                                    ".png, .svg or .pdf (needs the [plot] extra: matplotlib) "
                                    "of the entry --key names, else of the steady state's."),
) -> None:
    """Print a schedule set's entries (batch shape, decision, predicted gain), or one entry's
    pipeline and prediction; optionally draw a pipeline per stream."""
    from nanosched.fileio import PLOT_SUFFIXES, check_input_file, check_output_file
    from nanosched.schedules.sets import SINGLE_FORMAT, entry_schedule, load_schedule_set
    from nanosched.schedules.show import (
        PIPELINE_COLUMNS,
        SET_COLUMNS,
        pipeline_rows,
        plot_gantt,
        set_rows,
        set_summary_lines,
        summary_lines,
    )

    check_input_file(file, "schedule")
    if plot:
        check_output_file(plot, "--plot", PLOT_SUFFIXES)
        require_matplotlib()
    sset = load_schedule_set(file)
    if key is not None or sset.source_format == SINGLE_FORMAT:
        sched = entry_schedule(sset, key)
        print_table(pipeline_rows(sched), PIPELINE_COLUMNS)
        for line in summary_lines(sched):
            typer.echo(line)
    else:
        print_table(set_rows(sset), SET_COLUMNS)
        for line in set_summary_lines(sset):
            typer.echo(line)
    if plot:
        sched = entry_schedule(sset, key)
        plot_gantt(sched, plot)
        typer.echo(f"chart written to {plot}")


@app.command()
@reports_errors
def serve(
    model: str = typer.Option(..., "--model", "-m", help="Registered model name or HF "
                              "checkpoint folder / config.json."),
    weights: str | None = typer.Option(None, "--weights", help="'random' (seeded) or a "
                                       "checkpoint folder (default: the --model folder's "
                                       "weights, else random)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree (1 for now)."),
    schedule: str = typer.Option("auto", "--schedule", help="'auto' (a matching shipped "
                                 "schedule, else Sequential), 'sequential', 'two_batch', or a "
                                 "schedule JSON file (refused if made for another model, tp "
                                 "or GPU)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    port: int = typer.Option(8000, "--port", help="Port to bind."),
    dense_batch: int | None = typer.Option(None, "--dense-batch", help="Tokens per iteration "
                                           "(default: the schedule's; 2048 GPU, 256 CPU)."),
    max_queue: int = typer.Option(256, "--max-queue", help="Requests that may wait for "
                                  "admission; past it requests get 429."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    seed: int = typer.Option(0, "--seed", help="Seed of random weights and of sampling."),
    drain_timeout: float = typer.Option(30.0, "--drain-timeout", help="Seconds (a float >= 0) "
                                        "that SIGTERM or Ctrl-C gives open requests to finish; "
                                        "then each open stream ends with an error event and "
                                        "each other request gets a 503 JSON error."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="NANOSCHED_API_KEY",
                                       help="Require 'Authorization: Bearer <key>' on the /v1/ "
                                       "routes (401 without it), as vLLM's --api-key; "
                                       "/health and /metrics stay open. Without it, binding "
                                       "beyond loopback logs a warning."),
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="The model "
                                                 "id clients send and /v1/models lists "
                                                 "(default: the checkpoint folder's name, or "
                                                 "the registered model name)."),
    max_request_bytes: int = typer.Option(8 * 2**20, "--max-request-bytes", help="Largest "
                                          "request body accepted, in bytes (default 8 MiB); "
                                          "larger ones get 413 before they are read."),
    stats_interval: float = typer.Option(5.0, "--stats-interval", help="Seconds between the "
                                         "logged throughput / queue / KV-cache line, as vLLM's "
                                         "(0: off; an idle server logs none)."),
    graphs: str = typer.Option("auto", "--graphs", help="CUDA graphs per batch bucket: 'auto' "
                               "(on with a GPU), 'on' or 'off' (eager launches)."),
    admission: str = typer.Option("use", "--admission", help=ADMISSION_HELP),
    kv_headroom: float = typer.Option(0.0, "--kv-headroom", help=HEADROOM_HELP),
    preemption: str = typer.Option("recompute", "--preemption", help=PREEMPTION_HELP),
    swap_space: float = typer.Option(4.0, "--swap-space", help=SWAP_HELP),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help=KV_DTYPE_HELP),
    decode_attention: str = typer.Option("auto", "--decode-attention",
                                         help=DECODE_ATTENTION_HELP),
) -> None:
    """Serve the model over HTTP with OpenAI's completions and chat completions APIs."""
    try:
        from nanosched.runtime.server.app import run_server
        from nanosched.runtime.server.startup import ServeConfig
    except ImportError as exc:
        raise ConfigError(f"serve needs the serve extra ({exc.name} is missing): "
                          f"pip install -e '.[serve]'") from None

    from nanosched.runtime.config import EngineConfig
    from nanosched.runtime.preempt import AdmissionConfig

    admit = AdmissionConfig(policy=admission, headroom=kv_headroom, preemption=preemption,
                            swap_space_gib=swap_space)
    engine = EngineConfig(model=model, weights=weights, tp=tp, schedule=schedule,
                          dense_batch=dense_batch, device=device, seed=seed, graphs=graphs,
                          admission=admit, kv_dtype=kv_cache_dtype,
                          kernels=kernel_options(decode_attention))
    run_server(ServeConfig(engine, host=host, port=port, max_queue=max_queue,
                           drain_timeout_s=drain_timeout, max_request_bytes=max_request_bytes,
                           api_key=api_key, served_model_name=served_model_name,
                           stats_interval_s=stats_interval))


def main() -> None:
    """Console-script entry point."""
    app(prog_name="nanosched")


if __name__ == "__main__":
    sys.exit(main())
