"""Which strategy an engine runs: `--schedule` resolved to a `StrategyChoice`.

`choose_strategy` turns a registered strategy's name (`strategies.NAMED`, built for the GPU's
SM count: Sequential, TokenWeave's wave-aware two-batch split), auto (the shipped schedule that
matches this model, tp and GPU and predicts a gain, else Sequential, logged with the reason) or
a schedule FILE (a set or a single schedule, checked with `check_set_compatible` before any
weight loads, against the KV cache dtype and the weights' quantization too; `force` replays it
anyway) into the strategy object and the schedule it replays; `named_choice` rebuilds a choice
from its name (a tensor-parallel worker builds the strategy rank 0 chose); `open_streams` opens
the CUDA streams and green-context partitions a replay names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from nanosched.constants import DEFAULT_NUM_SMS, SEQUENTIAL
from nanosched.kernels.impls import network_impl
from nanosched.models.ops import NETWORK
from nanosched.models.spec import ModelSpec
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.opsched import OpScheduler

log = logging.getLogger("nanosched.loader")


def gpu_name(device: torch.device) -> str:
    """The GPU's name, as schedules record it ("cpu" on the CPU)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@dataclass
class StrategyChoice:
    """The strategy `--schedule` named, and the schedule set (or, for the timeline tools, the
    single schedule) it replays, if any."""

    strategy: OpScheduler
    name: str  # a name in strategies.NAMED | replay:<file>
    schedule: Any = None  # schedules.sets.ScheduleSet (engines) or schedules.format.Schedule
    forced_past: list[str] = field(default_factory=list)  # mismatches `force` let through

    def uses_copy_engine(self) -> bool:
        """Whether a pipeline of the schedule launches the copy-engine all-reduce (the engine
        then maps its buffers at start, on every rank)."""
        s = self.schedule
        if s is None:
            return False
        from nanosched.schedules.sets import PIPELINE

        schedules = [e.schedule for e in s.entries if e.kind == PIPELINE] \
            if hasattr(s, "entries") else [s]
        return any(network_impl(n.alloc.impl)[0] == "copy_engine"
                   for sched in schedules for n in sched.nano_ops
                   if n.resource == NETWORK and n.alloc.impl != "default")

    @property
    def dense_batch(self) -> int | None:
        s = self.schedule
        if s is None:
            return None
        return s.dense_batch if hasattr(s, "entries") else s.batch.dense_batch


def engine_quantization(cfg: EngineConfig) -> str:
    """The layer weights the engine of `cfg` will run (none | fp8): `cfg.quantization`, its
    `auto` resolved against the weights (models/quant.resolve_quantization; none without a
    model), before any weight loads."""
    from nanosched.models.quant import AUTO, NONE, resolve_quantization

    if cfg.quantization != AUTO:
        return resolve_quantization(cfg.quantization, "random")
    if cfg.model is None:
        return NONE
    from nanosched.runtime.loader import resolve_weights

    return resolve_quantization(cfg.quantization, resolve_weights(cfg.model, cfg.weights))


def choose_strategy(cfg: EngineConfig, spec: ModelSpec, device: torch.device) -> StrategyChoice:
    """The strategy of `cfg.schedule` (a name in strategies.NAMED | auto | FILE): a schedule set
    (or a single schedule, as a set of one entry) checked against this model, tp, GPU, KV
    cache dtype and weight quantization (refused unless `cfg.force`), replayed by `ReplaySet`."""
    from nanosched.runtime.strategies import NAMED, Sequential

    if cfg.schedule in NAMED:
        return named_choice(cfg.schedule, None, spec, device)
    from nanosched.schedules.sets import check_set_compatible, load_schedule_set

    if cfg.schedule == "auto":
        from nanosched.schedules.shipped import pick_shipped_schedule

        pick = pick_shipped_schedule(spec, cfg.tp, gpu_name(device), kv_dtype=cfg.kv_dtype,
                            quantization=engine_quantization(cfg))
        if pick.schedule is None:
            log.info("--schedule auto: running Sequential: %s", pick.reason)
            return StrategyChoice(Sequential(), SEQUENTIAL)
        log.info("--schedule auto: replaying %s", pick.reason)
        sset, where, forced = pick.schedule, str(pick.path), []
    else:
        sset, where = load_schedule_set(cfg.schedule), cfg.schedule
        forced = check_set_compatible(sset, spec, cfg.tp, gpu_name(device), force=cfg.force,
                                      kv_dtype=cfg.kv_dtype,
                                      quantization=engine_quantization(cfg))
        log.info("replaying schedule %s", where)
    return set_choice(sset, where, spec, forced)


def named_choice(name: str, schedule: Any, spec: ModelSpec,
                 device: torch.device) -> StrategyChoice:
    """The choice `StrategyChoice.name` names (a registered strategy, built for the GPU's SM
    count, or replay:<where> of `schedule`, a set already checked): how a tensor-parallel
    worker builds the strategy rank 0 chose."""
    from nanosched.runtime.strategies import NAMED

    if name in NAMED:
        sms = torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else DEFAULT_NUM_SMS
        return StrategyChoice(NAMED[name].for_gpu(sms), name)
    return set_choice(schedule, name.removeprefix("replay:"), spec)


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
