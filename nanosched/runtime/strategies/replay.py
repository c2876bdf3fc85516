"""`Replay(schedule)`: run a searched `nanosched.schedule/1` through the scheduling API.

The batch is split at every boundary of the schedule's nano-batch ranges; a nano-op is the
merged launch of the micro-batches its range covers. The CPU walks (layer, nano-op) pairs in
order of layer x period + predicted start and dispatches each when ready; data dependencies
become events, `resource` dependencies `after=` waits, and each nano-op runs on its stream and
SM mechanism with the launch config the profile measured. Given `rows=(D, T)` it replays on a
bucket near its key, each boundary moved within its decode or prefill part (`remap_rows`).

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nanosched.errors import ScheduleError
from nanosched.runtime.opsched import MAIN_STREAM, OpInstance, OpScheduler, SchedContext
from nanosched.runtime.program import LaunchConfig, Program
from nanosched.schedules.format import REPLAYED_FORMS, Schedule
from nanosched.schedules.format import NanoOp as ScheduledOp


@dataclass(frozen=True)
class _Entry:
    key: float
    order: int
    layer: int
    op: str
    lo: int
    hi: int
    stream: str
    launch: LaunchConfig | None
    waits: tuple[tuple[str, int, int, int], ...] = ()  # (op, layer, lo, hi) to follow
    lane: str = ""  # the schedule stream (several CUDA streams when mechanisms differ)
    period: int = 0  # layer + layer offset: the period the stream issues it in


def stream_key(n: ScheduledOp) -> str:
    mech = n.alloc.mechanism
    if mech == "green_ctx":
        return f"{n.stream}@gc{n.alloc.units}"
    if mech == "stream_priority":
        return f"{n.stream}@prio"
    return n.stream


def launch_config(n: ScheduledOp) -> LaunchConfig | None:
    # a compute point's implementation is a GEMM's; LaunchConfig applies it where it fits
    impl = None if n.alloc.impl in ("", "default") else n.alloc.impl
    mech, units = n.alloc.mechanism, n.alloc.units
    if mech == "green_ctx":
        return LaunchConfig(num_sms=units, impl=impl, partition=True)
    if mech == "cta_bound":
        return LaunchConfig(max_ctas=units, impl=impl) if n.resource != "compute" else \
            LaunchConfig(num_sms=units, impl=impl)
    return LaunchConfig(impl=impl) if impl else None


def _keep_lane_order(entries: list[_Entry]) -> list[_Entry]:
    """A schedule stream runs its nano-ops one after another, but it becomes several CUDA
    streams when its nano-ops use different SM mechanisms (`memory`, `memory@prio`, ...): each
    entry also waits for the one before it in its schedule stream when that one ran on another
    CUDA stream. (Without it a small op queued on the plain stream ran beside a prioritised
    attention, starved for 600 us, and held back the GEMM behind it:
    bench/engine/nanoop_timeline.py.) Issue order in a stream is by period (layer + offset), then
    `order`, as the simulator's."""
    lanes: dict[str, list[int]] = {}
    for k, e in enumerate(entries):
        lanes.setdefault(e.lane, []).append(k)
    out = list(entries)
    for ks in lanes.values():
        ks.sort(key=lambda k: (entries[k].period, entries[k].order))
        for a, b in zip(ks, ks[1:], strict=False):
            ea, eb = entries[a], out[b]
            if ea.stream != eb.stream:
                out[b] = replace(eb, waits=eb.waits + ((ea.op, ea.layer, ea.lo, ea.hi),))
    return out


def remap_rows(schedule: Schedule, rows: tuple[int, int]) -> dict[int, int]:
    """Each nano-batch boundary of `schedule` (searched at D' decode of T' tokens) moved onto a
    batch of D decode rows out of T: [0, D'] scales onto [0, D], [D', T'] onto [D, T]. Raises
    ScheduleError when the parts do not correspond (one is empty in one batch only) or two
    boundaries would meet (a nano-batch with no row)."""
    d0, t0 = schedule.batch.num_decode, schedule.batch.dense_batch
    d, t = rows
    if (d0 == 0) != (d == 0) or (d0 == t0) != (d == t) or not 0 <= d <= t or t < 1:
        raise ScheduleError(f"a schedule for {d0} decode of {t0} tokens cannot replay on "
                            f"{d} decode rows of {t}")
    bounds = {0, t0}
    for ranges in schedule.ranges.values():
        for lo, hi in ranges:
            bounds |= {lo, hi}
    out = {}
    for b in sorted(bounds):
        out[b] = round(b * d / d0) if b <= d0 and d0 else \
            d + round((b - d0) * (t - d) / (t0 - d0))
    vals = [out[b] for b in sorted(out)]
    if any(x >= y for x, y in zip(vals, vals[1:], strict=False)):
        raise ScheduleError(f"a schedule for {d0} decode of {t0} tokens has nano-batches too "
                            f"small to replay on {d} decode rows of {t}")
    return out


class Replay(OpScheduler):
    name = "replay"
    pipelined = True

    def __init__(self, schedule: Schedule, num_layers: int, resource_waits: bool = True,
                 rows: tuple[int, int] | None = None) -> None:
        bad = {g: f for g, f in schedule.forms.items() if f not in REPLAYED_FORMS}
        if bad:
            raise ScheduleError(f"schedule uses collective forms {bad}; the runtime replays "
                                f"all-reduce ('ar') only: search again without reduce-scatter")
        self.sched = schedule
        self.num_layers = num_layers
        self.resource_waits = resource_waits
        rows = rows or (schedule.batch.num_decode, schedule.batch.dense_batch)
        self._row = remap_rows(schedule, rows)
        self.dense_batch = rows[1]
        self.bounds = sorted(self._row.values())
        self._mb_at = {b: i for i, b in enumerate(self.bounds)}
        self.entries = self._entries()

    @property
    def streams(self) -> set[str]:
        return {e.stream for e in self.entries}

    def accepts(self, program: Program) -> bool:
        return program.num_tokens == self.dense_batch

    def _entries(self) -> list[_Entry]:
        s, period = self.sched, self.sched.prediction.solver_period_us
        by_id = {n.id: n for n in s.nano_ops}
        out, row = [], self._row
        for layer in range(self.num_layers):
            for n in s.nano_ops:
                waits = tuple((by_id[d.id].op, layer - d.shift, row[by_id[d.id].start],
                               row[by_id[d.id].end]) for d in n.deps
                              if d.kind == "resource" and self.resource_waits
                              and 0 <= layer - d.shift < self.num_layers)
                # start_us already holds the layer offset (it lies in [k τ, (k + 1) τ))
                out.append(_Entry(layer * period + n.start_us, n.order, layer,
                                  n.op, row[n.start], row[n.end], stream_key(n),
                                  launch_config(n), waits,
                                  n.stream, layer + n.layer_offset))
        out = _keep_lane_order(out)
        out += self._fillers(out)
        return sorted(out, key=lambda e: (e.key, e.order))

    def _fillers(self, entries: list[_Entry]) -> list[_Entry]:
        """Entries for the micro-batches an op's scheduled ranges leave out."""
        fill = []
        for op, ranges in self.sched.ranges.items():
            covered = sorted((self._row[lo], self._row[hi]) for lo, hi in ranges)
            gaps, at = [], 0
            for lo, hi in covered:
                if lo > at:
                    gaps.append((at, lo))
                at = max(at, hi)
            if at < self.dense_batch:
                gaps.append((at, self.dense_batch))
            for layer in range(self.num_layers):
                mine = [e for e in entries if e.op == op and e.layer == layer]
                last = max(mine, key=lambda e: e.key) if mine else None
                key = last.key + 1e-3 if last else layer * self.sched.prediction.period_us
                stream = last.stream if last else MAIN_STREAM
                fill += [_Entry(key, 0, layer, op, lo, hi, stream, None) for lo, hi in gaps]
        return fill

    def schedule(self, ctx: SchedContext) -> None:
        ctx.split([b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False)])
        index = {(op.op, op.layer): k for k, op in enumerate(ctx.program.ops)}
        embed = [n for i in range(ctx.num_micro_batches) for n in ctx.get_ready_ops(i)]
        ctx.execute(embed, stream=MAIN_STREAM)
        pending = list(self.entries)
        while pending:
            k = self._first_ready(ctx, pending, index)
            if k is None:
                if self._run_unnamed(ctx):
                    continue
                raise ScheduleError(f"replay is stuck: none of {len(pending)} remaining nano-ops "
                                    f"is ready (first: {pending[0].op} of layer "
                                    f"{pending[0].layer}); the schedule does not match this "
                                    f"model's program")
            e = pending.pop(k)
            group = [OpInstance(index[(e.op, e.layer)], i, *ctx.ranges[i])
                     for i in self._mbs(e.lo, e.hi)]
            after = [OpInstance(index[(op, layer)], i, *ctx.ranges[i])
                     for op, layer, lo, hi in e.waits for i in self._mbs(lo, hi)]
            ctx.execute(group, stream=e.stream, launch=e.launch, after=after)

    def _mbs(self, lo: int, hi: int) -> range:
        return range(self._mb_at[lo], self._mb_at[hi])

    def _first_ready(self, ctx: SchedContext, pending: list[_Entry],
                     index: dict[tuple[str, int], int]) -> int | None:
        for k, e in enumerate(pending):
            want = index[(e.op, e.layer)]
            if all(ctx.is_ready(want, i) for i in self._mbs(e.lo, e.hi)):
                return k
        return None

    def _run_unnamed(self, ctx: SchedContext) -> bool:
        """Run, on the main stream, the ready nano-ops of program ops the schedule never names:
        a schedule searched for a batch without prefill tokens has no `attn_prefill`, which the
        program still holds (over no rows). Whether any ran."""
        ready = [n for i in range(ctx.num_micro_batches) for n in ctx.get_ready_ops(i)
                 if ctx.program.ops[n.index].op not in self.sched.ranges]
        if ready:
            ctx.execute(ready, stream=MAIN_STREAM)
        return bool(ready)
