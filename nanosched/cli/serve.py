"""`nanosched serve`: the engine behind OpenAI's completions and chat completions HTTP API
(nanosched.runtime.server; needs the serve extra)."""

from __future__ import annotations

import typer

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
    Seed,
    SwapSpace,
    admission_config,
    kernel_options,
    mem_util_kwargs,
    model_option,
    prefix_caching,
)
from nanosched.errors import ConfigError


def serve(
    model: str = model_option("Registered model name or HF checkpoint folder / config.json."),
    weights: str | None = typer.Option(None, "--weights", help="'random' (seeded) or a "
                                       "checkpoint folder (default: the --model folder's "
                                       "weights, else random)."),
    tp: int = typer.Option(1, *TP_FLAGS, help="Tensor-parallel degree: one process per GPU "
                           "(also vLLM's --tensor-parallel-size / -tp), "
                           "started by this command (this one schedules)."),
    schedule: str = typer.Option("auto", "--schedule", help="'auto' (a matching shipped "
                                 "schedule, else Sequential), a strategy by name ('sequential', "
                                 "the two-batch overlap: nanosched.runtime.strategies.NAMED), "
                                 "or a schedule JSON file (refused if made for another model, "
                                 "tp or GPU)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    port: int = typer.Option(8000, "--port", help="Port to bind."),
    dense_batch: int | None = typer.Option(None, "--dense-batch", help="Tokens per iteration "
                                           "(default: the schedule's; 2048 GPU, 256 CPU)."),
    max_queue: int = typer.Option(256, "--max-queue", help="Requests that may wait for "
                                  "admission; past it requests get 429."),
    device: EngineDevice = "auto",
    seed: Seed = 0,
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
    header_timeout: float = typer.Option(10.0, "--header-timeout", help="Seconds a "
                                         "connection has to send a request's headers (from "
                                         "connecting, or the previous response); later: 408, "
                                         "closed."),
    body_timeout: float = typer.Option(60.0, "--body-timeout", help="Seconds a request has "
                                       "to send its body once its headers are in; later: 408, "
                                       "closed."),
    max_connections: int | None = typer.Option(None, "--max-connections", help="Connections "
                                               "open at once; one more gets 503 and is closed "
                                               "(default: 1024, or fewer under a lower "
                                               "descriptor limit, ulimit -n)."),
    graphs: str = typer.Option("auto", "--graphs", help="CUDA graphs per batch bucket: 'auto' "
                               "(on with a GPU), 'on' or 'off' (eager launches)."),
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
    """Serve the model over HTTP with OpenAI's completions and chat completions APIs."""
    try:
        from nanosched.runtime.server.lifecycle import run_server
        from nanosched.runtime.server.startup import ServeConfig
    except ImportError as exc:
        raise ConfigError(f"serve needs the serve extra ({exc.name} is missing): "
                          f"pip install -e '.[serve]'") from None

    from nanosched.runtime.config import EngineConfig

    engine = EngineConfig(model=model, weights=weights, tp=tp, schedule=schedule,
                          dense_batch=dense_batch, device=device, seed=seed, graphs=graphs,
                          admission=admission_config(admission, kv_headroom, preemption,
                                                     swap_space),
                          kv_dtype=kv_cache_dtype, max_context=max_model_len, dtype=dtype,
                          prefix_caching=prefix_caching(enable_prefix_caching,
                                                        no_enable_prefix_caching),
                          quantization=quantization,
                          **mem_util_kwargs(gpu_memory_utilization),
                          kernels=kernel_options(decode_attention, collective))
    run_server(ServeConfig(engine, host=host, port=port, max_queue=max_queue,
                           drain_timeout_s=drain_timeout, max_request_bytes=max_request_bytes,
                           api_key=api_key, served_model_name=served_model_name,
                           stats_interval_s=stats_interval, header_timeout_s=header_timeout,
                           body_timeout_s=body_timeout, max_connections=max_connections))
