"""Engine assembly: one path from an `EngineConfig` to a running engine, for every command.

`load_engine(cfg)` is what `nanosched bench`, `serve`, `generate` and the timeline harness do:

1. the device (`--device auto|cpu|cuda`) and the model spec, its tp checked;
2. the strategy from `--schedule` (`choose_strategy`): sequential, two_batch (TokenWeave's
   wave-aware split, at the GPU's SM count), auto (the shipped schedule that matches this
   model, tp and GPU and predicts a gain, else Sequential, logged with the reason) or a
   schedule FILE, a set or a single schedule (checked with `check_compatible` before any
   weight loads; `force` replays it anyway), replayed by `ReplaySet`: per batch shape the
   set's entry, a pipeline or Sequential, or the fallback where it has none;
3. the model (`load_model`): bf16 on CUDA, fp32 on the CPU (where the Triton interpreter reads
   bf16 wrongly); seeded random weights or an HF checkpoint folder's (`resolve_weights`);
4. `build_engine`: the replay's CUDA streams and green-context partitions (`ReplayStreams`),
   the dense batch (the schedule's; a different `--dense-batch` is refused), the KV pages that
   fit (`kv_pages`), the context bound, EOS ids, `--graphs auto` → on with a GPU, then `Engine`.

The result, `LoadedEngine`, owns what must be released (the partitions): close it, or use it
as a context manager. Commands that build several engines on one model (`bench --compare`)
call `load_model` once and `build_engine` per strategy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from nanosched.constants import DEFAULT_NUM_SMS
from nanosched.errors import ConfigError
from nanosched.kernels.dispatch import KernelOptions
from nanosched.models.checkpoint import (
    checkpoint_files,
    checkpoint_folder,
    eos_ids,
    load_checkpoint,
)
from nanosched.models.model import CausalLM
from nanosched.models.parallel import TensorParallel
from nanosched.models.spec import ModelSpec, load_spec
from nanosched.models.weights import init_random
from nanosched.runtime.config import GRAPH_MODES, EngineConfig
from nanosched.runtime.engine import Engine
from nanosched.runtime.requests import Request
from nanosched.runtime.scheduler import OpScheduler

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


def model_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU; fp32 on the CPU (the Triton interpreter reads bf16 wrongly there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


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
             requests: list[Request] | None, kv_dtype: str = "auto") -> int:
    """Pages that fit in the GPU memory left after weights and buffers (CPU: what the
    requests could ever need, at most 1 GiB). Unknown requests (None, a server): all the GPU
    memory left, or on the CPU room for 64 requests of the model's full context."""
    spec = model.spec
    page_bytes = page_size * spec.kv_bytes_per_token(kv_dtype=kv_dtype,
                                                     dtype_bytes=model.dtype.itemsize)
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


def gpu_name(device: torch.device) -> str:
    """The GPU's name, as schedules record it ("cpu" on the CPU)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@dataclass
class StrategyChoice:
    """The strategy `--schedule` named, and the schedule set (or, for the timeline tools, the
    single schedule) it replays, if any."""

    strategy: OpScheduler
    name: str  # sequential | two_batch | replay:<file>
    schedule: Any = None  # schedules.sets.ScheduleSet (engines) or schedules.format.Schedule
    forced_past: list[str] = field(default_factory=list)  # mismatches `force` let through

    @property
    def dense_batch(self) -> int | None:
        s = self.schedule
        if s is None:
            return None
        return s.dense_batch if hasattr(s, "entries") else s.batch.dense_batch


def choose_strategy(cfg: EngineConfig, spec: ModelSpec, device: torch.device) -> StrategyChoice:
    """The strategy of `cfg.schedule` (sequential | two_batch | auto | FILE): a schedule set
    (or a single schedule, as a set of one entry) checked against this model, tp, GPU and KV
    cache dtype (refused unless `cfg.force`), replayed by `ReplaySet`."""
    from nanosched.runtime.strategies import Sequential, TwoBatchOverlap

    if cfg.schedule == "sequential":
        return StrategyChoice(Sequential(), "sequential")
    if cfg.schedule == "two_batch":
        sms = torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else DEFAULT_NUM_SMS
        return StrategyChoice(TwoBatchOverlap(num_sms=sms), "two_batch")
    from nanosched.schedules.sets import check_set_compatible, load_schedule_set

    if cfg.schedule == "auto":
        from nanosched.schedules.shipped import pick_shipped

        pick = pick_shipped(spec, cfg.tp, gpu_name(device), kv_dtype=cfg.kv_dtype)
        if pick.schedule is None:
            log.info("--schedule auto: running Sequential: %s", pick.reason)
            return StrategyChoice(Sequential(), "sequential")
        log.info("--schedule auto: replaying %s", pick.reason)
        sset, where, forced = pick.schedule, str(pick.path), []
    else:
        sset, where = load_schedule_set(cfg.schedule), cfg.schedule
        forced = check_set_compatible(sset, spec, cfg.tp, gpu_name(device), force=cfg.force,
                                      kv_dtype=cfg.kv_dtype)
        log.info("replaying schedule %s", where)
    return set_choice(sset, where, spec, forced)


def set_choice(sset: Any, where: str, spec: ModelSpec,
               forced: list[str] | None = None) -> StrategyChoice:
    """`ReplaySet` of a loaded (and checked) schedule set over `spec`'s layers."""
    from nanosched.runtime.strategies.replay_set import ReplaySet

    return StrategyChoice(ReplaySet(sset, spec.num_layers), f"replay:{where}", sset,
                          forced or [])


def replay_choice(sched: Any, where: str, spec: ModelSpec,
                  forced: list[str] | None = None) -> StrategyChoice:
    """`Replay` of one loaded (and checked) schedule over `spec`'s layers (the timeline
    tools, which replay one batch shape)."""
    from nanosched.runtime.strategies.replay import Replay

    return StrategyChoice(Replay(sched, spec.num_layers), f"replay:{where}", sched,
                          forced or [])


def open_streams(choice: StrategyChoice, device: torch.device) -> Any:
    """The CUDA streams and green-context partitions a replayed schedule names (None for
    other strategies and on the CPU); close them when done."""
    if choice.schedule is None or device.type != "cuda":
        return None
    from nanosched.runtime.streams import ReplayStreams

    return ReplayStreams(choice.strategy.streams, device.index or 0)


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

    @property
    def model(self) -> CausalLM:
        return self.engine.model

    def close(self) -> None:
        """Release the green-context partitions (the engine must not step afterwards)."""
        if self.streams is not None:
            self.streams.close()
            self.streams = None

    def __enter__(self) -> LoadedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_engine(model: CausalLM, cfg: EngineConfig, choice: StrategyChoice, *,
                 requests: list[Request] | None = None,
                 on_token: Any = None) -> LoadedEngine:
    """The engine for `model` and a chosen strategy: streams, dense batch, KV pages sized for
    `requests` (None: unknown, as a server's), context bound, EOS ids, graphs."""
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
    streams = open_streams(choice, device)
    try:
        engine = Engine(model, resolved, strategy=choice.strategy,
                        device=streams.device if streams is not None else None,
                        on_token=on_token)
    except BaseException:
        if streams is not None:
            streams.close()
        raise
    return LoadedEngine(engine, resolved, model.spec, choice, streams)


def load_engine(cfg: EngineConfig, *, requests: list[Request] | None = None,
                on_token: Any = None, tp: TensorParallel | None = None) -> LoadedEngine:
    """Everything from the config: device, spec, strategy (checked before the weights load),
    model, engine. `tp` is this process's rank group when `cfg.tp` > 1."""
    if cfg.model is None:
        raise ConfigError("EngineConfig.model is not set: name a model or an HF folder")
    spec = load_spec(cfg.model)
    spec.check_tp(cfg.tp)
    device = resolve_device(cfg.device, tp.rank if tp is not None and cfg.tp > 1 else None)
    resolve_graphs(cfg.graphs, device, GRAPH_MODES)  # a bad mode fails before the weights load
    choice = choose_strategy(cfg, spec, device)
    resolve_dense_batch(cfg.dense_batch, choice, device)
    weights = resolve_weights(cfg.model, cfg.weights)
    if weights == "random":
        log.info("%s: random weights (seed %d)", cfg.model, cfg.seed)
    model = load_model(spec, weights, device, cfg.seed, tp, cfg.kernels)
    return build_engine(model, cfg, choice, requests=requests, on_token=on_token)
