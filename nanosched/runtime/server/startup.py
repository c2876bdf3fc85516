"""What `nanosched serve` does before the port opens: flags → model, schedule, engine.

The schedule is chosen and validated first (before the weights load), so a schedule for
another model, tp or GPU stops the server at once with the reason (`ScheduleError`, exit 2):
- `sequential`: the `Sequential` strategy;
- a FILE: `load_schedule` + `check_compatible`, replayed with `Replay` (on CUDA through
  `ReplayStreams`); its dense batch is the engine's unless `--dense-batch` agrees;
- `auto`: the shipped schedule that matches (schedules/shipped.py), else Sequential, logging
  which and why.
Batches the chosen strategy does not accept fall back to Sequential (`EngineStats.fallbacks`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from nanosched.errors import ConfigError
from nanosched.models.checkpoint import eos_ids
from nanosched.models.generate import checkpoint_folder
from nanosched.models.spec import ModelSpec, load_spec
from nanosched.runtime.bench import build_model, kv_pages, resolve_device, resolve_graphs
from nanosched.runtime.engine import Engine
from nanosched.runtime.preempt import AdmissionConfig
from nanosched.runtime.server.text import TextCodec

log = logging.getLogger("nanosched.serve")


@dataclass(frozen=True)
class ServeConfig:
    """What `nanosched serve` was asked for."""

    model: str
    weights: str | None = None  # None: the checkpoint folder's weights, else random
    tp: int = 1
    schedule: str = "auto"  # auto | sequential | a schedule JSON file
    host: str = "127.0.0.1"
    port: int = 8000
    dense_batch: int | None = None  # None: the schedule's, else 2048 on a GPU, 256 on the CPU
    max_queue: int = 256
    device: str = "auto"
    seed: int = 0
    page_size: int = 16
    mem_util: float = 0.85
    drain_timeout_s: float = 30.0
    graphs: str = "auto"  # auto (on with a GPU) | on | off: CUDA graphs per batch bucket
    admission: str = "use"  # KV admission and preemption (runtime/preempt.py)
    kv_headroom: float = 0.0
    preemption: str = "recompute"
    swap_space_gib: float = 4.0

    def admission_config(self) -> AdmissionConfig:
        return AdmissionConfig(policy=self.admission, headroom=self.kv_headroom,
                               preemption=self.preemption, swap_space_gib=self.swap_space_gib)


@dataclass
class Served:
    """A model ready to serve: the engine (not yet running), its text codec and limits."""

    name: str
    spec: ModelSpec
    engine: Engine
    codec: TextCodec
    strategy: str
    closer: Any = None  # ReplayStreams to close at exit


@dataclass
class _Choice:
    strategy: Any
    name: str
    dense_batch: int | None = None
    schedule: Any = None


def _check_flags(cfg: ServeConfig) -> None:
    if cfg.tp != 1:
        raise ConfigError(f"--tp {cfg.tp}: serving runs one process on one GPU for now; "
                          f"use --tp 1")
    if not 0 <= cfg.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {cfg.port}")
    if cfg.max_queue < 1:
        raise ConfigError(f"--max-queue must be at least 1, got {cfg.max_queue}")
    if cfg.dense_batch is not None and cfg.dense_batch < 1:
        raise ConfigError(f"--dense-batch must be positive, got {cfg.dense_batch}")
    cfg.admission_config()  # range-checks the admission flags


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def choose_strategy(cfg: ServeConfig, spec: ModelSpec, device: torch.device) -> _Choice:
    """The strategy `--schedule` names, validated against this model, tp and GPU."""
    from nanosched.runtime.strategies import Sequential
    from nanosched.schedules.format import check_compatible, load_schedule
    from nanosched.schedules.shipped import pick_shipped

    if cfg.schedule == "sequential":
        return _Choice(Sequential(), "sequential")
    if cfg.schedule == "auto":
        pick = pick_shipped(spec, cfg.tp, gpu_name(device))
        if pick.schedule is None:
            log.info("--schedule auto: running Sequential: %s", pick.reason)
            return _Choice(Sequential(), "sequential")
        log.info("--schedule auto: replaying %s", pick.reason)
        sched, where = pick.schedule, str(pick.path)
    else:
        sched, where = load_schedule(cfg.schedule), cfg.schedule
        check_compatible(sched, spec, cfg.tp, gpu_name(device))
        log.info("replaying schedule %s", where)
    from nanosched.runtime.strategies.replay import Replay

    return _Choice(Replay(sched, spec.num_layers), f"replay:{where}",
                   sched.batch.dense_batch, sched)


def _dense_batch(cfg: ServeConfig, choice: _Choice, device: torch.device) -> int:
    if choice.dense_batch is None:
        return cfg.dense_batch or (2048 if device.type == "cuda" else 256)
    if cfg.dense_batch is not None and cfg.dense_batch != choice.dense_batch:
        raise ConfigError(f"--dense-batch {cfg.dense_batch} differs from the schedule's "
                          f"{choice.dense_batch}: omit it or search a schedule for it")
    return choice.dense_batch


def prepare(cfg: ServeConfig) -> Served:
    """Check the flags, choose the schedule, build the model and the engine."""
    _check_flags(cfg)
    spec = load_spec(cfg.model)
    device = resolve_device(cfg.device)
    graphs = resolve_graphs(cfg.graphs, device, ("on", "off"))
    choice = choose_strategy(cfg, spec, device)
    dense = _dense_batch(cfg, choice, device)
    folder = checkpoint_folder(cfg.model)
    weights = cfg.weights or (str(folder) if folder is not None else "random")
    if weights == "random":
        log.info("%s: random weights (seed %d)", cfg.model, cfg.seed)
    model = build_model(spec, weights, device, cfg.seed)
    streams = None
    if choice.schedule is not None and device.type == "cuda":
        from nanosched.runtime.streams import ReplayStreams

        streams = ReplayStreams(choice.strategy.streams, device.index or 0)
    pages = kv_pages(model, dense, cfg.page_size, cfg.mem_util, None)
    engine = Engine(model, dense_batch=dense, num_pages=pages, page_size=cfg.page_size,
                    strategy=choice.strategy, eos_ids=eos_ids(cfg.model), seed=cfg.seed,
                    device=streams.device if streams else None, graphs=graphs,
                    admission=cfg.admission_config())
    log.info("%s on %s: strategy %s, dense batch %d, %d KV pages of %d tokens, CUDA graphs %s",
             spec.name, gpu_name(device), choice.name, dense, pages, cfg.page_size, graphs)
    return Served(cfg.model, spec, engine, TextCodec.for_model(cfg.model), choice.name,
                  streams)
