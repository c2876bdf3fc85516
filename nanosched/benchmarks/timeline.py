"""One forward per strategy, timed on every rank of a tp group (bench/engine/replay_timeline.py).

`run_rank(tp, cfg)` is what each process does (the same work in the same order on every rank,
so that their collectives pair up): build the tp-sharded `CausalLM` with seeded random weights
and the strategies' streams through the engine loader (runtime/loader.py), plan the schedule's
full batch (decode tokens with the workload's context, then prompt chunks;
the same token ids on every rank), and time Sequential, Replay(schedule) and TwoBatchOverlap
eagerly, as a CUDA graph and as a per-stream timeline, each checked against Sequential.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanosched.benchmarks.common import environment, synthetic_batch
from nanosched.constants import MULTICAST_OFF, PAGE_SIZE, SAFE_PATH, SEQUENTIAL
from nanosched.errors import ScheduleError
from nanosched.kernels.impls import network_impl
from nanosched.models.parallel import TensorParallel, launch
from nanosched.models.spec import ModelSpec, load_spec
from nanosched.runtime.backend import Backend
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.device import CudaDevice, SerialDevice, Span, TimedCudaDevice
from nanosched.runtime.loader import (
    choose_strategy,
    gpu_name,
    load_model,
    open_streams,
    replay_choice,
    resolve_device,
)
from nanosched.runtime.modelprogram import model_program
from nanosched.runtime.opsched import run_program
from nanosched.runtime.strategies import Sequential, TwoBatchOverlap
from nanosched.runtime.strategies.replay import Replay
from nanosched.schedules.format import Schedule, check_compatible, load_schedule

STRATEGIES = (Sequential.name, Replay.name, TwoBatchOverlap.name)


@dataclass(frozen=True)
class TimelineConfig:
    schedule: str  # schedule file
    layers: int = 0  # 0: the model's
    model: str | None = None  # model name or HF folder; None: the schedule's model name
    device: str = "cuda"  # "cuda" (bf16, graphs) or "cpu" (fp32, eager only)
    eager_reps: int = 5
    graph_reps: int = 10
    force: bool = False  # replay a schedule made for another model, tp or GPU
    seed: int = 0
    networks: tuple[str, ...] = ("nccl",)  # Sequential's all-reduce, one run each (tp > 1)


def with_layers(spec: ModelSpec, layers: int) -> ModelSpec:
    """`spec` with `layers` decoder layers (unchanged for 0)."""
    return spec.__class__(**{**spec.to_json(), "num_layers": layers}) if layers else spec


class TimedSerialDevice(SerialDevice):
    """The CPU's timeline: wall clock around every launch (`TimedCudaDevice`'s spans)."""

    def __init__(self) -> None:
        super().__init__()
        self._spans: list[Span] = []

    def launch(self, stream: Any, fn: Any) -> None:
        a = time.perf_counter()
        fn()
        self._spans.append(Span("", str(stream), a * 1e3, time.perf_counter() * 1e3))

    def spans(self) -> list[Span]:
        out, self._spans = self._spans, []
        return out


class _Rank:
    """One rank's model, batch and helpers; every method does the same work on every rank."""

    def __init__(self, tp: TensorParallel, cfg: TimelineConfig, sched: Schedule,
                 spec: ModelSpec, copy_engine: bool = False) -> None:
        self.tp, self.cfg, self.sched, self.spec = tp, cfg, sched, spec
        self.cuda = cfg.device == "cuda"
        self.device = resolve_device(cfg.device, tp.rank)
        self.model = load_model(spec, "random", self.device, cfg.seed, tp,
                                copy_engine=copy_engine)
        b = sched.batch
        self.ws = self.model.new_workspace(
            b.dense_batch, num_pages=b.num_decode * (int(b.decode_context) // PAGE_SIZE + 2) + 512)
        gen = torch.Generator(self.device).manual_seed(cfg.seed * 1000 + tp.rank)
        self.ws.kv.fill_random(gen)  # cached context: finite values (this rank's heads)
        torch.manual_seed(cfg.seed)  # the same token ids on every rank
        self.meta, self.segments, _ = synthetic_batch(self.ws, b.dense_batch, b.num_decode,
                                                      int(b.decode_context), b.prompt_len, 0)
        self.tokens = b.dense_batch

    def sync(self) -> None:
        """Finish this rank's GPU work, then meet the other ranks."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if self.tp.size > 1:
            dist.barrier()
            if self.cuda:
                torch.cuda.synchronize(self.device)

    def forward(self, strategy: Any, device: Any) -> None:
        program = model_program(self.model, self.ws, self.meta, self.segments)
        run_program(program, strategy, Backend(device))

    def output(self) -> torch.Tensor:
        """The final normed hidden states (identical on every rank after the all-reduces)."""
        return self.ws.normed[: self.tokens].float().clone()

    def eager(self, strategy: Any, device: Any) -> tuple[float, float]:
        wall, cpu = [], []
        for _ in range(self.cfg.eager_reps):
            self.sync()
            t0 = time.perf_counter()
            self.forward(strategy, device)
            t1 = time.perf_counter()
            if self.cuda:
                torch.cuda.synchronize(self.device)
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((t1 - t0) * 1e3)
        return statistics.median(wall), statistics.median(cpu)

    def graphed(self, strategy: Any, device: Any) -> float:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        self.sync()
        # thread_local: the NCCL watchdog thread may query events while this thread captures
        mode = "thread_local" if self.tp.size > 1 else "global"
        with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side,
                                                       capture_error_mode=mode):
            self.forward(strategy, device)  # forks from and joins to `side`
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph.replay()
        self.sync()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(self.cfg.graph_reps):
            graph.replay()
        b.record()
        b.synchronize()
        ms = a.elapsed_time(b) / self.cfg.graph_reps
        self.sync()
        del graph
        return ms

    def timeline(self, strategy: Any, device: Any) -> dict[str, Any]:
        timed = (TimedCudaDevice(dict(device._streams), dict(device._priorities))
                 if self.cuda else TimedSerialDevice())
        self.sync()
        self.forward(strategy, timed)
        self.sync()
        per_stream: dict[str, float] = {}
        spans = timed.spans()
        for sp in spans:
            per_stream[sp.stream] = per_stream.get(sp.stream, 0.0) + sp.end_ms - sp.start_ms
        total = max(sp.end_ms for sp in spans) - min(sp.start_ms for sp in spans)
        return {"span_ms": total, "busy_ms_per_stream": per_stream,
                "sum_busy_ms": sum(per_stream.values())}


def load_checked(cfg: TimelineConfig, tp: int, gpu_name: str | None
                 ) -> tuple[Schedule, ModelSpec]:
    """The schedule and the full model spec, refused if the schedule is for another model or
    tp (or GPU, on CUDA; None: not checked) unless forced; the spec is checked before
    `--layers` trims it."""
    sched = load_schedule(cfg.schedule)
    spec = load_spec(cfg.model or sched.model["name"])
    reasons = check_compatible(sched, spec, tp, gpu_name or "", force=True)
    if cfg.device != "cuda" or gpu_name is None:  # a CPU run stands in for the schedule's GPU
        reasons = [r for r in reasons if not r.startswith("gpu:")]
    if reasons and not cfg.force:
        raise ScheduleError(f"schedule {cfg.schedule} does not match this run: "
                            + "; ".join(reasons) + " (search one for it, or --force)")
    return sched, spec


def run_rank(tp: TensorParallel, cfg: TimelineConfig) -> dict[str, Any]:
    """This rank's measurements of every strategy (docs/runtime.md)."""
    cuda = cfg.device == "cuda"
    device = resolve_device(cfg.device, tp.rank)
    sched, full = load_checked(cfg, tp.size, gpu_name(device))
    spec = with_layers(full, cfg.layers)
    if tp.size > 1:  # the communicator exists before any capture
        x = torch.ones(1, device=device)
        dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize(device)
    replay = replay_choice(sched, cfg.schedule, spec)
    networks = cfg.networks if tp.size > 1 else cfg.networks[:1]
    ce = tp.size > 1 and (replay.uses_copy_engine() or any(
        network_impl(n)[0] == "copy_engine" for n in networks))
    r = _Rank(tp, cfg, sched, spec, copy_engine=ce)
    streams = open_streams(replay, device)  # green contexts of a replay on CUDA, else None
    overlap = choose_strategy(EngineConfig(schedule=TwoBatchOverlap.name), spec,
                              device).strategy
    plain = CudaDevice if cuda else SerialDevice
    base = r.model.kernels
    runs = [(SEQUENTIAL if i == 0 else f"{SEQUENTIAL}[{n}]", Sequential(), plain(), n)
            for i, n in enumerate(networks)]
    runs += [(Replay.name, replay.strategy, streams.device if streams else plain(), base.network),
             (TwoBatchOverlap.name, overlap, plain(), base.network)]
    out: dict[str, Any] = {"environment": environment(device), "rank": tp.rank, "tp": tp.size,
                           "layers": spec.num_layers, "dense_batch": sched.batch.dense_batch,
                           "results": {}}
    reference = None
    with torch.inference_mode():
        for name, strategy, dev, network in runs:
            r.model.kernels = replace(base, network=network)
            row: dict[str, Any] = {"network": network}
            row["eager_wall_ms"], row["eager_cpu_launch_ms"] = r.eager(strategy, dev)
            got = r.output()
            if reference is None:
                reference = got
            row["check"] = _compare(got, reference)
            if cuda:
                try:
                    row["graph_ms"] = r.graphed(strategy, dev)
                except Exception as exc:  # report why a capture failed, keep measuring
                    # (a failure that is the same on every rank; one rank alone failing leaves
                    # the others waiting in a collective until NCCL's watchdog times out)
                    row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    torch.cuda.synchronize(device)
            row["timeline"] = r.timeline(strategy, dev)
            out["results"][name] = row
    if streams is not None:
        streams.close()
    if tp.size > 1:
        mine = {k: {m: v.get(m) for m in ("eager_wall_ms", "graph_ms")}
                for k, v in out["results"].items()}
        every: list[Any] = [None] * tp.size
        dist.all_gather_object(every, mine)
        out["per_rank"] = every
    return out


def _compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, Any]:
    """Relative L2 error and max abs difference of a strategy's output vs Sequential's."""
    rel = float((got - want).norm() / want.norm().clamp_min(1e-30))
    finite = bool(torch.isfinite(got).all())
    return {"rel_l2_vs_sequential": rel, "max_abs_diff": float((got - want).abs().max()),
            "finite": finite}


def run(cfg: TimelineConfig, tp: int = 1) -> dict[str, Any]:
    """`run_rank` on one process (tp = 1) or on `tp` spawned ranks; rank 0's result."""
    if tp == 1:
        return run_rank(TensorParallel(), cfg)
    os.environ.update(SAFE_PATH)  # the spawned ranks import nothing of the current folder
    if cfg.device == "cuda":
        os.environ.update(MULTICAST_OFF)  # inherited by the spawned ranks
        if torch.cuda.device_count() < tp:
            raise ScheduleError(f"--tp {tp} needs {tp} GPUs; this machine has "
                                f"{torch.cuda.device_count()}")
    return launch(run_rank, tp, "nccl" if cfg.device == "cuda" else "gloo", cfg)


def find_profile(sched: Schedule, arg: str | None = None) -> tuple[Any, str]:
    """The profile a schedule was searched with: `arg` (FILE or shipped NAME), else the shipped
    profile whose digest the schedule records; (None, why) when there is none."""
    from nanosched.profiler.catalog import load_named_profile, shipped_profiles
    from nanosched.profiler.format import load_profile

    if arg:
        prof = load_named_profile(arg)
        return prof, arg
    for name, path in shipped_profiles().items():
        prof = load_profile(path)
        if prof.digest() == sched.profile_digest:
            return prof, name
    return None, f"no shipped profile has digest {sched.profile_digest} (pass --profile)"


def predict(sched: Schedule, spec: ModelSpec, profile: Any) -> dict[str, Any]:
    """The schedule's own prediction and, with its profile, the simulator's at `spec`'s layer
    count: layer period of the replay and of Sequential (both without the LM head)."""
    from nanosched.autosearch.simulate import sequential_baseline, simulate

    p = sched.prediction
    out: dict[str, Any] = {"predicted_period_us": p.period_us,
                           "predicted_sequential_period_us": p.sequential_period_us,
                           "predicted_speedup": p.speedup, "schedule_prediction": asdict(p)}
    if profile is not None:
        sim = simulate(sched, profile, num_layers=spec.num_layers)
        seq_period, seq_iter = sequential_baseline(spec, sched.tp, profile, sched.batch)
        out["simulated"] = {"layers": spec.num_layers, "period_us": sim.period_us,
                            "forward_us": sim.iteration_us - sim.lm_head_us,
                            "sequential_period_us": seq_period,
                            "sequential_forward_us": seq_iter - sim.lm_head_us,
                            "speedup": (seq_iter - sim.lm_head_us)
                            / (sim.iteration_us - sim.lm_head_us)}
    return out


def result_path(tp: int) -> Path:
    """$OUT or bench/results/: replay_timeline.json (tp = 1), replay_timeline-tp<N>.json."""
    name = "replay_timeline.json" if tp == 1 else f"replay_timeline-tp{tp}.json"
    return Path(os.environ.get("OUT", "bench/results")) / name
