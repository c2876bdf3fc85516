"""Assemble the schedule from stage I's structure and stage II's allocation; pure Python.

Besides the data and prompt dependencies of the op graph, the schedule carries resource
dependencies that keep the solver's cross-stream order (`resource_deps`), so that a replay that
starts every nano-op as soon as possible runs together only what the solver ran together.
The solver's placement is then compacted to the least period these dependencies allow, kept
if the GPU capacity still holds.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

from nanosched.autosearch.check import check_points
from nanosched.autosearch.durations import FULL_SHARE, TICKS_PER_US
from nanosched.autosearch.opgraph import (
    NanoDep,
    NanoOpDef,
    OpGraph,
    TokenMix,
    expand,
    nano_deps,
    precedences,
)
from nanosched.autosearch.periodic import Precedence, min_period
from nanosched.autosearch.stage1_model import Structure
from nanosched.autosearch.stage2 import Allocation
from nanosched.errors import ScheduleError
from nanosched.models.spec import ModelSpec
from nanosched.profiler.format import Profile
from nanosched.schedules.format import (
    Alloc,
    BatchInfo,
    Dep,
    NanoOp,
    Prediction,
    Schedule,
    StageReport,
    StreamInfo,
    model_record,
)
from nanosched.schedules.validate import check_capacity


def resource_deps(structure: Structure, alloc: Allocation) -> dict[str, list[tuple[str, int]]]:
    """Nano-op id -> [(id, layer shift)] that keep the solver's cross-stream order.

    For each nano-op x and each other stream, x waits for the last nano-op y of that stream
    (of the previous, same or next layer: shift 1, 0 or -1) that the solver finished before x
    started. Every pair the solver kept apart then stays apart in any placement that honours
    these dependencies, so nano-ops run together only where the solver let them: the GPU
    capacity holds and an as-soon-as-possible replay is never slower than the solver's period.
    """
    starts, durs, period = alloc.starts, alloc.durations, alloc.period
    out: dict[str, list[tuple[str, int]]] = {x: [] for x in starts}
    for x in starts:
        for sn, chain in structure.orders.items():
            if sn == structure.streams[x]:
                continue
            best: tuple[int, str, int] | None = None
            for y in chain:
                for copy in (-1, 0, 1):
                    end = starts[y] + durs[y] + copy * period
                    if end <= starts[x] and (best is None or end > best[0]):
                        best = (end, y, -copy)
            if best is not None:
                out[x].append((best[1], best[2]))
    return out


def compact(structure: Structure, alloc: Allocation, deps: list[Precedence]) -> Allocation:
    """The same structure and options at the least period its dependencies allow.

    The solver may stop with slack; with durations, orders, offsets and the (data and
    resource) dependencies fixed, `periodic.min_period` finds the tightest placement. The caller
    keeps it only if the GPU capacity still holds there.
    """
    found = min_period(alloc.durations, structure.orders, deps, structure.offsets)
    if found is None or found[0] >= alloc.period:
        return alloc
    return dataclasses.replace(alloc, starts=found[1], period=found[0])


def _deps(n: NanoOpDef, data: list[NanoDep], res: list[tuple[str, int]]) -> tuple[Dep, ...]:
    deps = [Dep(d.src, d.shift, d.kind) for d in data]
    have = {(d.id, d.shift) for d in deps}
    deps += [Dep(i, shift, "resource") for i, shift in res if (i, shift) not in have]
    return tuple(deps)


def build_schedule(spec: ModelSpec, tp: int, profile: Profile, graph: OpGraph, mix: TokenMix,
                   batch: BatchInfo, structure: Structure, alloc: Allocation,
                   stages: tuple[StageReport, ...], command: str = "") -> Schedule:
    """The schedule, its prediction from the simulator and the sequential baseline."""
    from nanosched.autosearch.simulate import simulate

    nanos = expand(graph, structure.split, mix, structure.forms)
    data = nano_deps(graph, nanos, mix, structure.forms)
    res = resource_deps(structure, alloc)
    sched = _assemble(spec, tp, profile, nanos, data, res, batch, structure,
                      alloc, stages, command)
    edges = precedences(data)
    edges += [Precedence(x, y, k) for y, ds in res.items() for x, k in ds]
    tight = compact(structure, alloc, edges)
    if tight is not alloc:
        candidate = _assemble(spec, tp, profile, nanos, data, res, batch, structure, tight,
                              stages, command)
        try:
            check_capacity(candidate)
            check_points(candidate)
            sched = candidate
        except ScheduleError:
            pass
    sim = simulate(sched, profile)
    pred = dataclasses.replace(sched.prediction, period_us=sim.period_us,
                               iteration_us=sim.iteration_us, tokens_per_s=sim.tokens_per_s)
    return dataclasses.replace(sched, prediction=pred)


def _assemble(spec: ModelSpec, tp: int, profile: Profile, nanos: list[NanoOpDef],
              data: dict[str, list[NanoDep]], res: dict[str, list[tuple[str, int]]],
              batch: BatchInfo, structure: Structure, alloc: Allocation,
              stages: tuple[StageReport, ...], command: str) -> Schedule:
    from nanosched.autosearch.simulate import sequential_baseline

    rank = {x: i for chain in structure.orders.values() for i, x in enumerate(chain)}
    ops = []
    for n in nanos:
        opt = alloc.choice[n.id]
        ops.append(NanoOp(
            n.id, n.op, n.resource, n.work_start, n.work_end, structure.streams[n.id],
            rank[n.id], structure.offsets[n.id], _deps(n, data[n.id], res[n.id]),
            Alloc(opt.share / FULL_SHARE, opt.p, opt.mechanism.value, opt.units, opt.impl,
                  opt.point, opt.side.value if opt.side else ""),
            alloc.starts[n.id] / TICKS_PER_US, alloc.durations[n.id] / TICKS_PER_US))
    ranges: dict[str, tuple[tuple[int, int], ...]] = {}
    for n in ops:
        ranges[n.op] = (*ranges.get(n.op, ()), (n.start, n.end))
    streams = tuple(StreamInfo(
        sn, sn, tuple(sorted({n.alloc.mechanism for n in ops if n.stream == sn})),
        tuple(sorted({n.alloc.units for n in ops if n.stream == sn})))
        for sn in structure.orders)
    optimal = profile.ceilings.gemm_tflops_model * 1e12 / (2 * spec.num_params(active=True))
    seq_period, seq_iter = sequential_baseline(spec, tp, profile, batch)
    period = alloc.period / TICKS_PER_US
    pred = Prediction(period, period, period * spec.num_layers, 0.0, optimal, seq_period,
                      seq_iter)
    return Schedule(model_record(spec), tp, profile.identity.gpu_name, profile.identity.num_sms,
                    profile.digest(), batch, ranges, dict(structure.forms), streams,
                    tuple(ops), pred, stages,
                    datetime.now(timezone.utc).isoformat(timespec="seconds"), command,
                    profile.notes[:1], kv_dtype=profile.kv_dtype,
                    quantization=profile.quantization)
