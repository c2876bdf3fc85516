"""Engine assembly: one path from an `EngineConfig` to a running engine, for every command.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from nanosched.errors import ConfigError
from nanosched.kernels.dispatch import KernelOptions
from nanosched.kernels.impls import network_impl
from nanosched.models.checkpoint import (
    checkpoint_files,
    checkpoint_folder,
    eos_ids,
    load_checkpoint,
)
from nanosched.models.model import CausalLM
from nanosched.models.parallel import TensorParallel
from nanosched.models.quant import check_fp8_device, check_model_dtype, resolve_quantization
from nanosched.models.spec import ModelSpec, load_spec
from nanosched.models.weights import init_random
from nanosched.runtime.choice import (  # noqa: F401 (re-exported: the commands import them here)
    StrategyChoice,
    choose_strategy,
    gpu_name,
    named_choice,
    open_streams,
    replay_choice,
    set_choice,
)
from nanosched.runtime.config import GRAPH_MODES, EngineConfig
from nanosched.runtime.engine import Engine
from nanosched.runtime.requests import Request
from nanosched.runtime.sampling import transient_bytes

log = logging.getLogger("nanosched.loader")
DEFAULT_DENSE_BATCH = {"cuda": 2048, "cpu": 256}


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


def model_dtype(device: torch.device, dtype: str = "auto") -> torch.dtype:
    """`--dtype`: auto is bf16 on a GPU and fp32 on the CPU (the Triton interpreter reads bf16
    wrongly there, so half precision is a GPU's only)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type != "cuda":
        raise ConfigError(f"--dtype {dtype}: the CPU runs models in float32 (--dtype auto); "
                          f"{dtype} needs a GPU")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def check_engine_flags(cfg: EngineConfig, spec: ModelSpec, device: torch.device) -> None:
    """vLLM's `--dtype` and `--max-model-len` against the device and the model, before any
    weights load or rank starts."""
    model_dtype(device, cfg.dtype)
    if cfg.max_context is not None and cfg.max_context > spec.max_position_embeddings:
        raise ConfigError(f"--max-model-len {cfg.max_context} exceeds {spec.name}'s "
                          f"{spec.max_position_embeddings} positions")


def resolve_weights(model: str, weights: str | None) -> str:
    """'random' or a checkpoint folder: `weights` when given, else the folder `model` names
    when it holds safetensors, else random. A folder is checked here, before any model is
    built (`checkpoint_files`: index, shard paths, headers)."""
    if weights is not None:
        if weights != "random":
            checkpoint_files(weights)
        return weights
    folder = checkpoint_folder(model)
    if folder is None:
        return "random"
    checkpoint_files(folder)  # a damaged folder is named before the model is built
    return str(folder)


def load_model(spec: ModelSpec, weights: str, device: torch.device, seed: int = 0,
               tp: TensorParallel | None = None, kernels: KernelOptions | None = None,
               copy_engine: bool = False, quantization: str = "auto",
               dtype: str = "auto") -> CausalLM:
    """`spec`'s model on `device` (this rank's shards at tp > 1) in `model_dtype(device)`,
    with seeded random weights (`weights == "random"`) or the checkpoint folder's, its layer
    weights quantised as `quantization` resolves (models/quant.py). At tp > 1 with
    `copy_engine` (or `kernels.network` naming it) the all-reduces' buffers are mapped for the
    copy-engine all-reduce (collective: every rank loads the same way)."""
    kernels = kernels or KernelOptions()
    tp = tp or TensorParallel()
    if copy_engine or network_impl(kernels.network)[0] == "copy_engine":
        tp = tp.with_copy_engine(device)
    model = CausalLM(spec, tp=tp, dtype=model_dtype(device, dtype), device=device,
                     kernels=kernels, quantization=resolve_quantization(quantization, weights))
    if weights == "random":
        init_random(model, seed)
    else:
        load_checkpoint(model, weights)
    return model


RESERVE_MARGIN = 1 << 30  # cuBLAS and Triton workspaces, the CUDA-graph pool, fragmentation


def reserve_bytes(model: Any, dense_batch: int) -> int:
    """GPU memory an engine takes beside its weights and KV pages: the workspace's buffers for
    `dense_batch` tokens (exact), the logits of `dense_batch` sampled rows (twice at tp > 1:
    the gathered copy), the sampler's temporaries (runtime/sampling.py, drawn in chunks) and
    RESERVE_MARGIN. `bench --json` records the peak a run reached (`gpu_memory`)."""
    vocab, itemsize = model.spec.vocab_size, model.dtype.itemsize
    logits = dense_batch * vocab * itemsize * (2 if model.tp.size > 1 else 1)
    return (model.buffer_bytes(dense_batch) + logits + transient_bytes(dense_batch, vocab)
            + RESERVE_MARGIN)


def page_bytes(model: Any, page_size: int, kv_dtype: str) -> int:
    """Bytes of one KV page on this rank: its shard of the KV heads (a tp-sharded page is
    smaller), with the e4m3 cache's scales."""
    return page_size * model.spec.kv_bytes_per_token(tp=model.tp.size, kv_dtype=kv_dtype,
                                                     dtype_bytes=model.dtype.itemsize)


def kv_pages(model: Any, dense_batch: int, page_size: int, mem_util: float,
             requests: list[Request] | None, kv_dtype: str = "auto") -> int:
    """Pages that fit in the GPU memory left after weights and buffers (CPU: what the
    requests could ever need, at most 1 GiB). Unknown requests (None, a server): all the GPU
    memory left, or on the CPU room for 64 requests of the model's full context."""
    spec = model.spec
    page = page_bytes(model, page_size, kv_dtype)
    peaks = [r.peak_tokens for r in requests] if requests is not None else \
        [spec.max_position_embeddings] * 64
    need = sum(-(-p // page_size) + 1 for p in peaks)
    if model.device.type != "cuda":
        return max(1, min(need, (1 << 30) // page))
    if requests is None:
        need = 1 << 62
    free, total = torch.cuda.mem_get_info(model.device)
    budget = free - (1 - mem_util) * total - reserve_bytes(model, dense_batch)
    if budget < page * 2:
        raise ConfigError(f"no GPU memory left for the KV cache of {spec.name!r} "
                          f"({free / 2**30:.1f} GiB free)")
    return int(min(need, budget // page))


def resolve_graphs(mode: str, device: torch.device, allowed: tuple[str, ...]) -> str:
    """`--graphs auto` → on with a GPU, off on the CPU; other modes checked against `allowed`
    (a GPU needed for any that captures: layout lays batches out in buckets, run eagerly)."""
    if mode not in ("auto", *allowed):
        raise ConfigError(f"--graphs must be one of auto, {', '.join(allowed)}; got {mode!r}")
    if mode == "auto":
        return "on" if device.type == "cuda" else "off"
    if mode not in ("off", "layout") and device.type != "cuda":
        raise ConfigError(f"--graphs {mode} needs a CUDA GPU (graphs replay CUDA launches); "
                          f"use --graphs off or auto on the CPU")
    return mode


def resolve_dense_batch(requested: int | None, choice: StrategyChoice,
                        device: torch.device) -> int:
    """The schedule's dense batch (`--dense-batch` may only repeat it), else the requested
    one, else 2048 on a GPU and 256 on the CPU."""
    if choice.dense_batch is None:
        return requested or DEFAULT_DENSE_BATCH[device.type]
    if requested is not None and requested != choice.dense_batch:
        raise ConfigError(f"--dense-batch {requested} differs from the schedule's "
                          f"{choice.dense_batch}: omit it or search a schedule for {requested}")
    return choice.dense_batch


@dataclass
class LoadedEngine:
    """An engine ready to step, the resolved config it runs with, and what it holds."""

    engine: Engine
    config: EngineConfig  # every None / "auto" resolved
    spec: ModelSpec
    choice: StrategyChoice
    streams: Any = None  # ReplayStreams to close, or None
    link: Any = None  # rank 0 at tp > 1: the engine's end on the other ranks (EngineLink)
    group: Any = None  # the tensor-parallel RankGroup this engine started (tp > 1), or None

    @property
    def model(self) -> CausalLM:
        return self.engine.model

    def close(self) -> None:
        """Release the engine's CUDA graphs, the green-context partitions and, at tp > 1, the
        engine on the other ranks and the group it started (the engine must not step
        afterwards). The graphs go first: collectives captured in them hold the group."""
        graphs = getattr(self.engine, "graphs", None)
        if graphs is not None:
            graphs.release()
        if self.streams is not None:
            self.streams.close()
            self.streams = None
        link, self.link = self.link, None
        if link is not None:
            link.close()
        group, self.group = self.group, None
        if group is not None:
            group.close()

    def __enter__(self) -> LoadedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def agree_pages(model: CausalLM, cfg: EngineConfig) -> int:
    """KV pages every rank of a tp group holds: the least over the ranks of `cfg.num_pages`,
    on a GPU capped by what fits in that rank's free memory."""
    pages = cfg.num_pages
    if model.device.type == "cuda":
        pages = min(pages, kv_pages(model, cfg.dense_batch, cfg.page_size, cfg.mem_util, None,
                                    cfg.kv_dtype))
    return model.tp.agree_min(pages)


def build_engine(model: CausalLM, cfg: EngineConfig, choice: StrategyChoice, *,
                 requests: list[Request] | None = None, on_token: Any = None,
                 ranks: Any = None) -> LoadedEngine:
    """The engine for `model` and a chosen strategy: streams, dense batch, KV pages sized for
    `requests` (None: unknown, as a server's), context bound, EOS ids, graphs. At tp > 1 on
    rank 0, `ranks` (runtime/ranks/group.py) has every worker build the same engine, with the
    KV pages every rank can hold; a worker calls this with the config rank 0 resolved."""
    device = model.device
    graphs = resolve_graphs(cfg.graphs, device, GRAPH_MODES)
    dense = resolve_dense_batch(cfg.dense_batch, choice, device)
    pages = cfg.num_pages or kv_pages(model, dense, cfg.page_size, cfg.mem_util, requests,
                                      cfg.kv_dtype)
    longest = max((r.peak_tokens for r in requests), default=None) if requests else None
    eos = cfg.eos_ids if cfg.eos_ids is not None or cfg.model is None else \
        frozenset(eos_ids(cfg.model))
    resolved = replace(cfg, device=device.type, dense_batch=dense, num_pages=pages,
                       graphs=graphs, max_context=cfg.max_context or longest, eos_ids=eos)
    link = None
    if model.tp.size > 1:
        if model.tp.rank == 0:
            if ranks is None:
                raise ConfigError("a tp > 1 engine needs the group of ranks it runs on "
                                  "(runtime/ranks/group.py start_ranks)")
            link = ranks.open_engine(resolved, choice)
        resolved = replace(resolved, num_pages=agree_pages(model, resolved))
    streams = open_streams(choice, device)
    try:
        engine = Engine(model, resolved, strategy=choice.strategy,
                        device=streams.device if streams is not None else None,
                        on_token=on_token, link=link)
    except BaseException:
        if streams is not None:
            streams.close()
        raise
    return LoadedEngine(engine, resolved, model.spec, choice, streams, link)


def load_engine(cfg: EngineConfig, *, requests: list[Request] | None = None,
                on_token: Any = None) -> LoadedEngine:
    """Everything from the config: device, spec, strategy (checked before the weights load),
    model, engine. At `cfg.tp` > 1 this process is rank 0 of a group it starts (one worker
    process per other GPU, runtime/ranks/group.py), which the result closes."""
    if cfg.model is None:
        raise ConfigError("EngineConfig.model is not set: name a model or an HF folder")
    spec = load_spec(cfg.model)
    spec.check_tp(cfg.tp)
    device = resolve_device(cfg.device, 0 if cfg.tp > 1 else None)
    check_engine_flags(cfg, spec, device)
    resolve_graphs(cfg.graphs, device, GRAPH_MODES)  # a bad mode fails before the weights load
    choice = choose_strategy(cfg, spec, device)
    resolve_dense_batch(cfg.dense_batch, choice, device)
    weights = resolve_weights(cfg.model, cfg.weights)
    # refused before any rank starts (the model refuses it too, on every path)
    quantization = resolve_quantization(cfg.quantization, weights)
    check_model_dtype(quantization, model_dtype(device, cfg.dtype))
    check_fp8_device(quantization, device)
    if weights == "random":
        log.info("%s: random weights (seed %d)", cfg.model, cfg.seed)
    group = None
    copy_engine = choice.uses_copy_engine()
    if cfg.tp > 1:
        from nanosched.runtime.ranks.group import start_ranks

        group = start_ranks(cfg, weights, device, copy_engine)
    try:
        model = load_model(spec, weights, device, cfg.seed,
                           group.tp if group is not None else None, cfg.kernels,
                           copy_engine=copy_engine, quantization=cfg.quantization,
                           dtype=cfg.dtype)
        loaded = build_engine(model, cfg, choice, requests=requests, on_token=on_token,
                              ranks=group)
    except BaseException:
        if group is not None:
            group.close(failed=True)
        raise
    loaded.group = group
    return loaded
