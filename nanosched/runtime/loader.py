"""Engine assembly: the one place that turns flags into a model and the pieces around it.

- `resolve_device`: `--device auto|cpu|cuda` (auto: CUDA when torch sees a GPU).
- `resolve_weights` and `load_model`: the dtype rule (bf16 on CUDA, fp32 on the CPU, where
  Triton's interpreter mishandles bf16) and the weights: seeded random ones, or an HF
  checkpoint folder's (by default the folder `--model` names, if it holds safetensors).
- `kv_pages`: KV-cache pages that fit the GPU memory left after weights and buffers, or what
  the known requests could ever need.
- `resolve_graphs`: `--graphs auto` (on with a GPU) and the modes a command allows.
"""

from __future__ import annotations

from typing import Any

import torch

from nanosched.errors import ConfigError
from nanosched.kernels.dispatch import KernelOptions
from nanosched.models.checkpoint import checkpoint_folder, load_checkpoint
from nanosched.models.model import CausalLM
from nanosched.models.parallel import TensorParallel
from nanosched.models.spec import ModelSpec
from nanosched.models.weights import init_random
from nanosched.runtime.requests import Request


def resolve_device(name: str, rank: int | None = None) -> torch.device:
    """The torch device of `--device auto|cpu|cuda` (auto: CUDA when visible); with `rank`,
    on CUDA, that tp rank's GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible")
    return torch.device("cuda", rank) if name == "cuda" and rank is not None else \
        torch.device(name)


def model_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU; fp32 on the CPU (the Triton interpreter reads bf16 wrongly there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_weights(model: str, weights: str | None) -> str:
    """'random' or a checkpoint folder: `weights` when given, else the folder `model` names
    when it holds safetensors, else random."""
    if weights is not None:
        return weights
    folder = checkpoint_folder(model)
    return str(folder) if folder is not None else "random"


def load_model(spec: ModelSpec, weights: str, device: torch.device, seed: int = 0,
               tp: TensorParallel | None = None,
               kernels: KernelOptions | None = None) -> CausalLM:
    """`spec`'s model on `device` (this rank's shards at tp > 1) in `model_dtype(device)`,
    with seeded random weights (`weights == "random"`) or the checkpoint folder's."""
    model = CausalLM(spec, tp=tp or TensorParallel(), dtype=model_dtype(device), device=device,
                     kernels=kernels or KernelOptions())
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
