"""`nanosched generate`: one prompt served as one request by the engine, its continuation
printed as text (with a tokenizer) or token ids."""

from __future__ import annotations

import json

import typer

from nanosched.cli.options import (
    TP_FLAGS,
    Collective,
    DecodeAttention,
    Dtype,
    GpuMemoryUtilization,
    KvCacheDtype,
    MaxModelLen,
    NoPrefixCaching,
    PrefixCaching,
    Quantization,
    Seed,
    kernel_options,
    mem_util_kwargs,
    model_option,
    prefix_caching,
)
from nanosched.errors import ConfigError


def generate(
    model: str = model_option("Registered model name (random weights) or an HF checkpoint "
                              "folder (config.json + safetensors)."),
    prompt: str | None = typer.Option(None, "--prompt", help="Prompt text (needs a tokenizer "
                                      "in the checkpoint folder)."),
    prompt_ids: str | None = typer.Option(None, "--prompt-ids", help="Prompt token ids, "
                                          "comma-separated: 1,2,3."),
    max_tokens: int = typer.Option(32, "--max-tokens", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    tp: int = typer.Option(1, *TP_FLAGS, help="Tensor-parallel degree: one process per GPU "
                           "(also vLLM's --tensor-parallel-size / -tp), "
                           "started by this command (this one schedules)."),
    seed: Seed = 0,
    as_json: bool = typer.Option(False, "--json", help="Print prompt and output ids as JSON."),
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
    """Generate a continuation: the prompt served as one request by the engine."""
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
                          prefix_caching=prefix_caching(enable_prefix_caching,
                                                        no_enable_prefix_caching),
                          quantization=quantization,
                          max_context=max_model_len, dtype=dtype,
                          **mem_util_kwargs(gpu_memory_utilization),
                          kernels=kernel_options(decode_attention, collective))
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
