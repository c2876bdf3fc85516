"""`nanosched bench`: a workload served by the engine (Sequential, a strategy, or both in one
process with `--compare`), its throughput and latency printed through
nanosched.benchmarks.report and written as JSON."""

from __future__ import annotations

import typer

from nanosched.cli.common import sigterm_as_interrupt
from nanosched.cli.options import (
    TP_FLAGS,
    Admission,
    Collective,
    DecodeAttention,
    Dtype,
    EngineDevice,
    GpuMemoryUtilization,
    KvCacheDtype,
    KvHeadroom,
    MaxModelLen,
    NoPrefixCaching,
    Preemption,
    PrefixCaching,
    Quantization,
    SwapSpace,
    admission_config,
    kernel_options,
    mem_util_kwargs,
    model_option,
    prefix_caching,
)
from nanosched.constants import SEQUENTIAL


def bench(
    model: str = model_option("Model name or HF checkpoint folder."),
    tp: int = typer.Option(1, *TP_FLAGS, help="Tensor-parallel degree: one process per GPU "
                           "(also vLLM's --tensor-parallel-size / -tp), "
                           "started by this command (this one schedules)."),
    weights: str | None = typer.Option(None, "--weights", help="'random' (seeded) or a local "
                                       "HF checkpoint folder (default: the --model folder's "
                                       "weights, else random, as serve)."),
    input_len: int | None = typer.Option(None, "--input-len", help="Prompt tokens per request "
                                         "(with --output-len)."),
    output_len: int | None = typer.Option(None, "--output-len", help="Output tokens per "
                                          "request."),
    workload: str | None = typer.Option(None, "--workload", help="sharegpt, lmsys, splitwise "
                                        "(NanoFlow Table 4 statistics), a JSONL file, "
                                        "shared-prefix:groups=G,prefix=P,unique=U,output=O "
                                        "or multi-turn:turns=T,prompt=P,user=U,output=O."),
    num_prompts: int = typer.Option(100, "--num-prompts", help="Number of requests."),
    dense_batch: int | None = typer.Option(None, "--dense-batch", help="Tokens per iteration "
                                           "(default 2048 on a GPU, 256 on the CPU)."),
    schedule: str = typer.Option(SEQUENTIAL, "--schedule", help="A strategy by name "
                                 "('sequential', or the TokenWeave-style two-batch overlap; "
                                 "nanosched.runtime.strategies.NAMED lists them), 'auto' (a "
                                 "matching shipped schedule, else Sequential) or a schedule "
                                 "JSON file from `nanosched search`."),
    compare: bool = typer.Option(False, "--compare", help="Run Sequential, the strategy, then "
                                 "Sequential again on the same requests in this process "
                                 "(A-B-A) and report the strategy over the mean of both "
                                 "Sequential runs, and their drift."),
    force: bool = typer.Option(False, "--force", help="Replay a schedule made for another "
                               "model, tp or GPU."),
    request_rate: float = typer.Option(float("inf"), "--request-rate", help="Poisson arrivals "
                                       "per second (default: all at once, offline)."),
    seed: int = typer.Option(0, "--seed", help="Seed of lengths, token ids, arrivals, weights."),
    device: EngineDevice = "auto",
    warmup_prompts: int | None = typer.Option(None, "--warmup-prompts", help="Untimed requests "
                                              "served with every strategy first, so no run "
                                              "pays compilation a later one reuses (default: "
                                              "64 on a GPU; on the CPU 8 for a model of at "
                                              "most 1B parameters, else 0)."),
    graphs: str = typer.Option("auto", "--graphs", help="CUDA graphs: 'auto' (on with a GPU, "
                               "else off), 'off' (eager launches), 'on' (one graph per "
                               "strategy and batch bucket, captured when a bucket first "
                               "appears), or 'both' (every strategy eager, then with graphs)."),
    json_out: str | None = typer.Option(None, "--json", help="Write every figure, the "
                                        "configuration and the environment to this file."),
    admission: Admission = "use",
    kv_headroom: KvHeadroom = 0.0,
    preemption: Preemption = "recompute",
    swap_space: SwapSpace = 4.0,
    kv_cache_dtype: KvCacheDtype = "auto",
    enable_prefix_caching: PrefixCaching = False,
    no_enable_prefix_caching: NoPrefixCaching = False,
    quantization: Quantization = "auto",
    max_model_len: MaxModelLen = None,
    dtype: Dtype = "auto",
    gpu_memory_utilization: GpuMemoryUtilization = None,
    decode_attention: DecodeAttention = "auto",
    collective: Collective = "nccl",
) -> None:
    """Serve a workload with the engine and report throughput and latency (NanoFlow §6).

    Flag names follow `vllm bench throughput`. Benchmark mode ignores EOS and generates each
    request's given output length.
    """
    try:
        # the imports too (torch's takes seconds): a Ctrl-C there is reported as in serving
        with sigterm_as_interrupt():
            from nanosched.benchmarks import report
            from nanosched.benchmarks.throughput import BenchConfig, run_bench
            from nanosched.fileio import check_output_file, finite_json, write_json_atomic
            from nanosched.runtime.config import EngineConfig

            if json_out:
                check_output_file(json_out, "--json")
            engine = EngineConfig(
                model=model, tp=tp, weights=weights, device=device, seed=seed,
                schedule=schedule, force=force, dense_batch=dense_batch, graphs=graphs,
                admission=admission_config(admission, kv_headroom, preemption, swap_space),
                kv_dtype=kv_cache_dtype, max_context=max_model_len, dtype=dtype,
                prefix_caching=prefix_caching(enable_prefix_caching, no_enable_prefix_caching),
                quantization=quantization, **mem_util_kwargs(gpu_memory_utilization),
                kernels=kernel_options(decode_attention, collective))
            cfg = BenchConfig(engine, input_len=input_len, output_len=output_len,
                              workload=workload, num_prompts=num_prompts, compare=compare,
                              request_rate=request_rate, warmup_prompts=warmup_prompts)
            out = run_bench(cfg)
    except KeyboardInterrupt:
        typer.echo("bench interrupted: no results reported"
                   + (f" ({json_out} untouched)" if json_out else ""), err=True)
        raise typer.Exit(code=130) from None
    lines = report.header_lines(out, model, tp, seed)
    for name, run in out["runs"].items():
        lines += report.run_lines(name, run)
    for line in lines:
        typer.echo(line)
    for line, warning in report.ratio_lines(out):
        typer.echo(line)
        if warning:
            typer.echo(warning, err=True)
    if json_out:
        write_json_atomic(json_out, finite_json(out))
        typer.echo(f"wrote {json_out}")
