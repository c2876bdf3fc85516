"""Flags that several commands take with the same meaning, declared once.

Each alias is an `Annotated` type: a command writes `kv_cache_dtype: KvCacheDtype = "auto"`
and gets the flag, its help and its checks exactly as every other command that takes it. Flags
whose help says something particular to one command stay in that command's signature.
`model_option` spells `--model/-m` once with each command's own help.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from nanosched.errors import ConfigError

KV_DTYPE_HELP = ("KV cache element type, as vLLM's flag: 'auto' (the model's dtype) or 'fp8' "
                 "(e4m3 with one scale per token and KV head: about half the bytes, so twice "
                 "the tokens fit and the decode attention reads half as much).")
DECODE_ATTENTION_HELP = ("Decode attention kernel where a schedule names none: 'auto' "
                         "(cuda_bulk on an FP8 cache where it can run: a Hopper GPU with cupy "
                         "and cuda-bindings; else triton_pipelined), or triton_pipelined, "
                         "triton_pipelined_2w, triton_paged (on a CPU without Triton: the torch "
                         "reference), or 'cascade' (off by default): decode rows that share at "
                         "least one full prefix page with another decode row of the batch (prefix "
                         "caching) read those pages once per tile of rows; a batch without such "
                         "rows runs what 'auto' picks; it also overrides a schedule's decode "
                         "kernel.")
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


def model_option(help: str, default: Any = ...) -> Any:
    """`--model/-m` as a parameter's default, with a command's own help (what it accepts
    differs by command); required unless a `default` is given."""
    return typer.Option(default, "--model", "-m", help=help)


# the engine's flags (generate, bench, serve)
KvCacheDtype = Annotated[str, typer.Option("--kv-cache-dtype", help=KV_DTYPE_HELP)]
QUANTIZATION_HELP = ("Layer weights: auto (the checkpoint's quantization_config; random "
                     "weights: none), none, or fp8 (e4m3 weights with a scale per output "
                     "channel, activations with a dynamic scale per token; a bf16 checkpoint "
                     "is quantized as it loads).")
Quantization = Annotated[str, typer.Option("--quantization", "-q", help=QUANTIZATION_HELP)]
DecodeAttention = Annotated[str, typer.Option("--decode-attention", help=DECODE_ATTENTION_HELP)]
Collective = Annotated[str, typer.Option("--collective", help=(
    "The layers' all-reduce at --tp > 1: nccl, or copy_engine (peer copies on the GPUs' copy "
    "engines, readiness by stream memory operations, one small SM reduction; needs "
    "cuda-bindings). A searched schedule names its own per nano-op."))]
Admission = Annotated[str, typer.Option("--admission", help=ADMISSION_HELP)]
PrefixCaching = Annotated[bool, typer.Option("--enable-prefix-caching", help=(
    "Automatic prefix caching, as vLLM's flag (the default): full KV pages are kept by content "
    "and shared by requests whose prompts start alike, which prefill only the rest."))]
NoPrefixCaching = Annotated[bool, typer.Option("--no-enable-prefix-caching", help=(
    "Turn automatic prefix caching off, as vLLM's flag."))]


def prefix_caching(enable: bool, disable: bool) -> bool:
    """Whether prefix caching is on: the default, unless --no-enable-prefix-caching."""
    if enable and disable:
        raise ConfigError("give --enable-prefix-caching or --no-enable-prefix-caching, not both")
    return not disable
KvHeadroom = Annotated[float, typer.Option("--kv-headroom", help=HEADROOM_HELP)]
Preemption = Annotated[str, typer.Option("--preemption", help=PREEMPTION_HELP)]
SwapSpace = Annotated[float, typer.Option("--swap-space", help=SWAP_HELP)]
GpuMemoryUtilization = Annotated[float | None, typer.Option(
    "--gpu-memory-utilization", help=(
        "Share of each GPU's memory, in (0, 1], that weights, working buffers and the KV cache "
        "may fill, as vLLM's flag (default 0.85): the rest of it after weights and buffers is KV "
        "cache, so a higher share admits more requests at once."))]
Seed = Annotated[int, typer.Option("--seed", help="Seed of random weights and of sampling.")]
EngineDevice = Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")]

# the workload a search or a profile is sized for (NanoFlow Table 4 names or mean lengths)
WorkloadName = Annotated[str | None, typer.Option("--workload",
                                                  help="sharegpt, lmsys, splitwise.")]
MeanInputLen = Annotated[float | None, typer.Option("--input-len",
                                                    help="Mean prompt tokens p.")]
MeanOutputLen = Annotated[float | None, typer.Option("--output-len",
                                                     help="Mean output tokens d.")]

# the profiler's run flags
NoProgress = Annotated[bool, typer.Option("--no-progress", help="No progress bar.")]
ProfileOut = Annotated[Path | None, typer.Option(
    "--out", "-o", help="Profile to write (default: FILE, replaced atomically).")]


def kernel_options(decode_attention: str, collective: str = "nccl") -> Any:
    """The engine's KernelOptions for --decode-attention and --collective, refused with the
    flag's name."""
    from nanosched.kernels import impls
    from nanosched.kernels.dispatch import KernelOptions

    if decode_attention not in impls.DECODE_OPTIONS:
        raise ConfigError(f"--decode-attention must be one of {', '.join(impls.DECODE_OPTIONS)}; "
                          f"got {decode_attention!r}")
    if collective not in ("nccl", "copy_engine"):
        raise ConfigError(f"--collective must be nccl or copy_engine; got {collective!r}")
    return KernelOptions(decode_impl=decode_attention, network=collective)


def mem_util_kwargs(gpu_memory_utilization: float | None) -> dict[str, float]:
    """EngineConfig's `mem_util` from --gpu-memory-utilization (None: its default), refused
    with the flag's name outside (0, 1]."""
    if gpu_memory_utilization is None:
        return {}
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1] (a share of each GPU's "
                          f"memory); got {gpu_memory_utilization}")
    return {"mem_util": gpu_memory_utilization}


def admission_config(admission: str, kv_headroom: float, preemption: str,
                     swap_space: float) -> Any:
    """The engine's AdmissionConfig from the four admission flags (checked by it)."""
    from nanosched.runtime.kv_pool import AdmissionConfig

    return AdmissionConfig(policy=admission, headroom=kv_headroom, preemption=preemption,
                           swap_space_gib=swap_space)


# vLLM's engine flags under vLLM's names too (serve, bench, generate)
TP_FLAGS = ("--tp", "--tensor-parallel-size", "-tp")
MaxModelLen = Annotated[int | None, typer.Option("--max-model-len", help=(
    "Longest request in tokens, prompt and output (vLLM's flag; default: the model's "
    "positions)."))]
Dtype = Annotated[str, typer.Option("--dtype", help=(
    "Weights' and activations' dtype, as vLLM's flag: auto (bfloat16 on a GPU, float32 on "
    "the CPU), bfloat16 or float16 (on a GPU)."))]
