r"""Replay a schedule against a profile and predict its time; pure Python, no solver.

The replay does what the runtime does: in period p each stream issues, in its issue order, the
nano-op x of layer p − k_x (k_x its layer offset); a nano-op starts as soon as its stream is
free, every dependency (y of layer l − δ) has finished, its share of the GPU fits beside
the nano-ops running then and its allocation is compatible with each of theirs (point
consistency, `durations.compatible`: only pairs the profile measured run together) — as soon
as possible, never at the solver's placement.
Durations come from the profile: t_alone(op, work tokens, context) / P of its allocation
(on the whole GPU P = 1 / F, the op's settled factor in a forward of the batch's rows).
Over L layers it reports the steady period, one forward's iteration and tokens/s per GPU, and
prices the sequential baseline.

More in docs/search.md, module notes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from nanosched.autosearch.durations import PARTITION, compatible, op_context
from nanosched.autosearch.opgraph import TokenMix, layer_graph
from nanosched.constants import TOKEN_QUANTUM
from nanosched.errors import ScheduleError
from nanosched.models.spec import ModelSpec
from nanosched.profiler.format import Profile
from nanosched.schedules.format import Alloc, BatchInfo, NanoOp, Schedule


@dataclass(frozen=True)
class SimResult:
    period_us: float
    layer_latency_us: float  # first nano-op start to last end of one layer, steady state
    iteration_us: float
    lm_head_us: float
    tokens_per_s: float  # per GPU
    max_share: float  # the largest sum of shares running at once in the replay


def nano_time_us(profile: Profile, n: NanoOp, batch: BatchInfo) -> float:
    """t_alone / P of one nano-op, from the profile's kernel table."""
    ctx = op_context(n.op, batch.decode_context, batch.prompt_len)
    return profile.kernel_time_us(n.op, n.end - n.start, None, ctx) / n.alloc.p


def lm_head_us(profile: Profile, batch: BatchInfo) -> float:
    """LM head over the sampled tokens (rounded up to 128); 0 when the profile has no rows."""
    if not profile.token_grid("lm_head"):
        return 0.0
    sampled = batch.num_decode + (batch.dense_batch - batch.num_decode) / batch.prompt_len
    rounded = math.ceil(sampled / TOKEN_QUANTUM) * TOKEN_QUANTUM
    tokens = min(batch.dense_batch, max(TOKEN_QUANTUM, rounded))
    return profile.kernel_time_us("lm_head", tokens)


def point_alloc(n: NanoOp) -> Alloc:
    """n's allocation with its R->P point identity filled in for schedules written before
    allocations carried one: side from the nano-op's class, point from mechanism and R."""
    a = n.alloc
    if a.mechanism == "full" or (a.point and a.side):
        return a
    side = a.side or ("compute" if n.resource == "compute" else "other")
    if a.mechanism == PARTITION:
        return dataclasses.replace(a, side=side)
    r = 1 - a.share if side == "compute" else a.share
    return dataclasses.replace(a, point=a.point or f"{a.mechanism}@r={r:.3f}", side=side)


Placed = tuple[float, float, float, Alloc]  # start, end, share, allocation


def _fits(placed: list[Placed], t: float, dur: float, share: float, alloc: Alloc | None = None
          ) -> float | None:
    """None if `share` fits beside `placed` over [t, t + dur) and `alloc` is compatible with
    every nano-op running then (when given), else the next end to retry at."""
    if alloc is not None:
        clash = [b for a, b, _, other in placed
                 if a < t + dur - 1e-9 and b > t + 1e-9 and not compatible(alloc, other)]
        if clash:
            return min(clash)
    edges = sorted({t, *(a for a, _, _, _ in placed if t < a < t + dur)})
    for u in edges:
        running = [(b, r) for a, b, r, _ in placed if a <= u + 1e-9 and b > u + 1e-9]
        if sum(r for _, r in running) + share > 1 + 1e-9:
            return min(b for b, _ in running)
    return None


def replay(s: Schedule, durations: dict[str, float], num_layers: int
           ) -> dict[tuple[str, int], tuple[float, float]]:
    """(nano-op id, layer) -> (start, end) in us: in issue order, as soon as possible.

    A nano-op starts when its stream is free, its dependencies have finished and its share
    fits beside the nano-ops already running and its allocation is compatible with theirs (it
    waits for the next end, rather than oversubscribe the GPU or run an unmeasured pair).
    """
    by_id = {n.id: n for n in s.nano_ops}
    queues: dict[str, list[tuple[str, int]]] = {}
    for st in s.streams:
        chain = sorted((n for n in s.nano_ops if n.stream == st.name), key=lambda n: n.order)
        queues[st.name] = [(n.id, p - n.layer_offset) for p in range(num_layers + 1)
                           for n in chain if 0 <= p - n.layer_offset < num_layers]
    done: dict[tuple[str, int], tuple[float, float]] = {}
    heads, free = dict.fromkeys(queues, 0), dict.fromkeys(queues, 0.0)
    placed: list[Placed] = []
    allocs = {n.id: point_alloc(n) for n in s.nano_ops}
    while len(done) < len(s.nano_ops) * num_layers:
        ready = []
        for sn, queue in queues.items():
            if heads[sn] < len(queue):
                x, layer = queue[heads[sn]]
                need = [(d.id, layer - d.shift) for d in by_id[x].deps
                        if 0 <= layer - d.shift < num_layers]
                if all(k in done for k in need):
                    ready.append((max([free[sn]] + [done[k][1] for k in need]), sn, x, layer))
        if not ready:
            stuck = {sn: q[heads[sn]] for sn, q in queues.items() if heads[sn] < len(q)}
            raise ScheduleError(f"replay deadlocks: stream heads {stuck} wait on each other")
        t, sn, x, layer = min(ready)
        floor = min(free[q] for q in queues if heads[q] < len(queues[q]))
        placed = [p for p in placed if p[1] > floor]
        while (retry := _fits(placed, t, durations[x], by_id[x].alloc.share,
                              allocs[x])) is not None:
            t = retry
        done[(x, layer)] = (t, t + durations[x])
        placed.append((t, t + durations[x], by_id[x].alloc.share, allocs[x]))
        free[sn] = t + durations[x]
        heads[sn] += 1
    return done


def max_concurrent_share(s: Schedule, spans: dict[tuple[str, int], tuple[float, float]]
                         ) -> float:
    share = {n.id: n.alloc.share for n in s.nano_ops}
    events = sorted([(b, -share[x]) for (x, _), (a, b) in spans.items()]
                    + [(a, share[x]) for (x, _), (a, b) in spans.items()])
    level = peak = 0.0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def simulate(s: Schedule, profile: Profile, num_layers: int | None = None) -> SimResult:
    """Predict the period, iteration time and tokens/s of `s` on the profiled GPU."""
    num = num_layers or s.model["num_layers"]
    durations = {n.id: nano_time_us(profile, n, s.batch) for n in s.nano_ops}
    spans = replay(s, durations, num)
    finish = [0.0] * num
    first = [math.inf] * num
    for (_, layer), (a, b) in spans.items():
        finish[layer] = max(finish[layer], b)
        first[layer] = min(first[layer], a)
    half = num // 2
    period = (finish[-1] - finish[half - 1]) / (num - half) if num > 1 else finish[0]
    head = lm_head_us(profile, s.batch)
    iteration = finish[-1] + head
    return SimResult(period, finish[half] - first[half] if num > 1 else finish[0],
                     iteration, head, s.batch.dense_batch / (iteration * 1e-6) / s.tp,
                     max_concurrent_share(s, spans))


def sequential_op_times(spec: ModelSpec, tp: int, profile: Profile, batch: BatchInfo,
                        time_us: Callable[[str, int, float | None], float] | None = None,
                        settled: bool = True) -> dict[str, float]:
    """Each op of one layer over its whole token domain, alone on the full GPU, in us.
    `time_us(op, rows, context)` prices an op's rows (default: the profile's row at exactly
    that count, times its settled factor in a forward of the batch's rows unless not
    `settled`: `Profile.settled_factor`)."""
    mix = TokenMix(batch.dense_batch, batch.num_decode, batch.prompt_len)
    graph = layer_graph(spec, tp)
    t = batch.dense_batch
    price = time_us or (
        (lambda op, rows, ctx: profile.settled_time_us(op, rows, t, ctx)) if settled else
        (lambda op, rows, ctx: profile.kernel_time_us(op, rows, None, ctx)))
    times = {}
    for op in graph.active_ops({g: "ar" for g in graph.groups()}):
        lo, hi = mix.domain(op.domain)
        if hi > lo:
            times[op.name] = price(op.name, hi - lo,
                                   op_context(op.name, batch.decode_context, batch.prompt_len))
    return times


def sequential_baseline(spec: ModelSpec, tp: int, profile: Profile, batch: BatchInfo
                        ) -> tuple[float, float]:
    """(layer time, iteration time) in us: one stream, no split, full GPU."""
    period = sum(sequential_op_times(spec, tp, profile, batch).values())
    return period, period * spec.num_layers + lm_head_us(profile, batch)
