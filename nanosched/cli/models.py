"""`nanosched models` and `nanosched analyze`: the model registry and the cost model's
estimate of one iteration, neither needing a GPU."""

from __future__ import annotations

import json

import typer

from nanosched.cli.common import TP_FIT_BATCH, check_flag, default_gpu
from nanosched.cli.options import model_option
from nanosched.cli.report import MODEL_COLUMNS, print_analysis, print_table


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
    print_table(rows, [*MODEL_COLUMNS, ("tp", f"tp on {gpu}", "")])
    typer.echo("GiB: the weights alone; tp: the smallest whose GPUs hold the weights and the KV "
               "cache of a 1,024-token dense batch at 1024 / 512 (nanosched analyze)")


def analyze(
    model: str = model_option("Model name (e.g. llama3-70b) or an HF config.json / folder."),
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
    from nanosched.hardware import get_gpu
    from nanosched.models.costmodel import analyze as run_analysis
    from nanosched.models.costmodel import choose_tp
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
    print_analysis(result)
