"""The independent checker: every constraint class of the search, re-verified without a solver.

`check_schedule(schedule, profile)` raises ScheduleError naming the violated constraint and the
nano-op. Layer copies repeat every P = `prediction.solver_period_us`; a nano-op x of layer l
runs over [s_x + l P, s_x + d_x + l P). Checked, without the solver: structure, dependencies,
stream order, the layer period, GPU capacity and point consistency, durations, the profile.

More in docs/search.md, module notes.
"""

from __future__ import annotations

from dataclasses import replace

from nanosched.autosearch.durations import (
    TICKS_PER_US,
    alloc_options,
    compatible,
    describe,
    op_context,
)
from nanosched.autosearch.opgraph import NanoOpDef, TokenMix, layer_graph, nano_deps
from nanosched.autosearch.simulate import nano_time_us, point_alloc
from nanosched.errors import ConfigError, ProfileError, ScheduleError
from nanosched.profiler.format import Profile, check_profile_for
from nanosched.schedules.format import MODEL_FIELDS, Schedule
from nanosched.schedules.validate import EPS_US, check_capacity, unrolled, validate_structure

TOL_US = 1e-3


def _fail(constraint: str, nano_op: str, why: str) -> ScheduleError:
    return ScheduleError(f"constraint '{constraint}' violated at {nano_op}: {why}")


def check_schedule(s: Schedule, profile: Profile) -> None:
    """Raise ScheduleError naming the first violated constraint and nano-op."""
    _check_profile(s, profile)
    try:
        validate_structure(s)
    except ScheduleError as exc:
        raise _fail("structure", "schedule", str(exc)) from None
    _check_graph(s, profile)
    _check_dep_times(s)
    _check_issue_order(s)
    _check_overlaps(s)
    try:
        check_capacity(s)
    except ScheduleError as exc:
        raise _fail("GPU capacity", "schedule", str(exc)) from None
    check_points(s)
    _check_durations(s, profile)


def _check_profile(s: Schedule, profile: Profile) -> None:
    """The profile is the one the schedule was searched on (its digest) and fits the model,
    tp and KV cache the schedule records (`check_profile_for`)."""
    if s.profile_digest != profile.digest():
        raise _fail("profile", "schedule", f"made from profile {s.profile_digest}, checked "
                    f"against {profile.digest()}")
    try:
        spec = replace(profile.model, **{k: s.model.get(k) for k in MODEL_FIELDS})
        check_profile_for(profile, spec, s.tp, kv_dtype=s.kv_dtype,
                          quantization=s.quantization)
    except (ConfigError, ProfileError) as exc:  # a model no spec can have, or another one
        raise _fail("profile", "schedule", str(exc)) from None


def _check_graph(s: Schedule, profile: Profile) -> None:
    graph = layer_graph(profile.model, s.tp)
    mix = TokenMix(s.batch.dense_batch, s.batch.num_decode, s.batch.prompt_len)
    for op in graph.active_ops(s.forms):
        lo, hi = mix.domain(op.domain)
        if hi > lo and op.name not in s.ranges:
            raise _fail("op graph", op.name, "op of the layer has no nano-ops")
    index: dict[str, int] = {}
    defs = []
    for n in s.nano_ops:
        defs.append(NanoOpDef(n.op, index.setdefault(n.op, 0), n.resource, n.start, n.end,
                              n.start, n.end))
        index[n.op] += 1
    names = {d.id: n.id for d, n in zip(defs, s.nano_ops, strict=True)}
    need = nano_deps(graph, defs, mix, s.forms)
    for d in defs:
        have = {(dep.id, dep.shift) for dep in s.nano_op(names[d.id]).deps}
        for src, shift, kind in need[d.id]:
            if (names[src], shift) not in have:
                what = "periodic cross-layer" if shift else kind
                raise _fail("dependencies", names[d.id], f"missing {what} dependency on "
                            f"{names[src]} (shift {shift})")


def _check_dep_times(s: Schedule) -> None:
    period = s.prediction.solver_period_us
    for n in s.nano_ops:
        for d in n.deps:
            x = s.nano_op(d.id)
            if n.start_us + d.shift * period < x.end_us - TOL_US:
                raise _fail("dependencies", n.id, f"starts at {n.start_us:.1f} us (+{d.shift} "
                            f"period) before {x.id} ends at {x.end_us:.1f} us")


def _check_issue_order(s: Schedule) -> None:
    period = s.prediction.solver_period_us
    for n in s.nano_ops:
        if int((n.start_us + EPS_US) // period) != n.layer_offset:
            raise _fail("issue order", n.id, f"start {n.start_us:.1f} us is in period "
                        f"{int(n.start_us // period)}, layer_offset says {n.layer_offset}")
    for st in s.streams:
        chain = sorted((n for n in s.nano_ops if n.stream == st.name), key=lambda n: n.order)
        phases = [n.start_us - n.layer_offset * period for n in chain]
        for a, b, pa, pb in zip(chain, chain[1:], phases, phases[1:], strict=False):
            if pb < pa - TOL_US:
                raise _fail("issue order", b.id, f"issued after {a.id} on stream {st.name} "
                            f"but its phase {pb:.1f} us precedes {pa:.1f} us")


def _check_overlaps(s: Schedule) -> None:
    spans = sorted(unrolled(s), key=lambda t: t[0])
    for i, (_a0, a1, x, kx) in enumerate(spans):
        for b0, _b1, y, ky in spans[i + 1:]:
            if b0 >= a1 - TOL_US:
                break
            if (x.id, kx) == (y.id, ky):
                continue
            if x.stream == y.stream:
                raise _fail("stream no-overlap", y.id, f"layer {ky} overlaps {x.id} of layer "
                            f"{kx} on stream {x.stream} ({b0:.1f} < {a1:.1f} us)")
            if x.resource == y.resource and x.resource != "other":
                raise _fail("same-class no-overlap", y.id, f"layer {ky} overlaps {x.id} of "
                            f"layer {kx}, both {x.resource}-bound")


def check_points(s: Schedule) -> None:
    """No two nano-ops with allocations never measured together run at once (unrolled)."""
    allocs = {n.id: point_alloc(n) for n in s.nano_ops}
    spans = sorted(unrolled(s), key=lambda t: t[0])
    for i, (_a0, a1, x, kx) in enumerate(spans):
        for b0, _b1, y, ky in spans[i + 1:]:
            if b0 >= a1 - TOL_US:
                break
            if x.id == y.id:
                continue
            ax, ay = allocs[x.id], allocs[y.id]
            if not compatible(ax, ay):
                raise _fail("point consistency", y.id, f"layer {ky} overlaps {x.id} of layer "
                            f"{kx} ({b0:.1f} < {a1:.1f} us), but {y.id}'s {describe(ay)} and "
                            f"{x.id}'s {describe(ax)} were never measured together (only "
                            f"green_ctx options mix, but not two HBM streams of the memory "
                            f"table; a cta_bound / stream_priority point runs only beside its "
                            f"own other side)")


def _check_durations(s: Schedule, profile: Profile) -> None:
    options: dict[str, list] = {}
    tick = 1 / TICKS_PER_US
    for n in s.nano_ops:
        key = f"{n.resource}/{n.op}/{n.end - n.start}"
        ctx = op_context(n.op, s.batch.decode_context, s.batch.prompt_len)
        opts = options.setdefault(key, alloc_options(profile, n.resource, n.op, n.end - n.start,
                                                     s.batch.dense_batch, ctx))
        a = n.alloc
        if not any(abs(o.share / 1000 - a.share) < 1e-9 and abs(o.p - a.p) < 1e-9
                   and o.mechanism == a.mechanism
                   and (not a.point or (o.point, o.side) == (a.point, a.side)) for o in opts):
            where = f" ({a.mechanism} point {a.point}, {a.side} side)" if a.point else ""
            raise _fail("durations", n.id, f"allocation share {a.share:g} / P {a.p:g}{where} "
                        f"is not a point of the profile's R->P table")
        want = nano_time_us(profile, n, s.batch)
        if not want - TOL_US <= n.duration_us <= want + tick + TOL_US:
            raise _fail("durations", n.id, f"duration {n.duration_us:.2f} us, the profile "
                        f"says {want:.2f} us (t_alone / P)")
