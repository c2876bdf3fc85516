"""Point consistency: only allocation pairs the profile measured run at once, in stage II, the
simulator and the checker (a GEMM's side of one R->P point never beside attention's side of
another)."""

import dataclasses
import itertools

import pytest
from search_fixtures import small_profile, small_schedule

from nanosched.autosearch.check import check_points, check_schedule
from nanosched.autosearch.cpsat import Limits
from nanosched.autosearch.durations import AllocOption, alloc_options, compatible
from nanosched.autosearch.simulate import _fits, nano_time_us, replay
from nanosched.autosearch.stage2 import Stage2Problem, solve_stage2
from nanosched.errors import ScheduleError
from nanosched.profiler.format import load_profile
from nanosched.schedules.format import Alloc, Schedule

FULL = AllocOption(1000, 1.0, "full", 132)
# Point q0 (cta_bound): GEMM 0.6 beside attention bounded to 128 CTAs at 0.33.
# Point q1 (stream_priority): attention 0.93 beside a GEMM that gets 0.1.
X_OPTS = [FULL, AllocOption(30, 0.6, "cta_bound", 132, point="t:0", side="compute"),
          AllocOption(95, 0.1, "stream_priority", 132, point="t:1", side="compute")]
Y_OPTS = [FULL, AllocOption(970, 0.33, "cta_bound", 128, point="t:0", side="other"),
          AllocOption(905, 0.93, "stream_priority", 132, point="t:1", side="other")]


def brute_force(prob: Stage2Problem, consistent: bool) -> tuple[int, dict[str, AllocOption]]:
    """Least period on the integer grid, two nano-ops on two streams (cf. test_stages)."""
    ids = list(prob.alone)
    for tau in range(1, 60):
        for choice in itertools.product(*(prob.options[x] for x in ids)):
            opt = dict(zip(ids, choice, strict=True))
            d = {x: o.ticks(prob.alone[x]) for x, o in opt.items()}
            for starts in itertools.product(range(tau), repeat=len(ids)):
                s = dict(zip(ids, starts, strict=True))
                if any(s[x] + d[x] > 2 * tau or d[x] > tau for x in ids):
                    continue
                if any(s[y] + k * tau < s[x] + d[x] for x, y, k in prob.deps):
                    continue
                spans = [(s[x] + k * tau, s[x] + d[x] + k * tau, x) for x in ids
                         for k in (0, 1, 2)]
                if not all(sum(opt[x].share for a, b, x in spans if a <= t < b) <= 1000
                           for t in range(3 * tau)):
                    continue
                if consistent and any(
                        x != y and a < b2 and a2 < b and not compatible(opt[x], opt[y])
                        for a, b, x in spans for a2, b2, y in spans):
                    continue
                return tau, opt
    raise AssertionError("no period below 60")


def _problem(x_opts, y_opts) -> Stage2Problem:
    return Stage2Problem({"x": 10.0, "y": 8.0}, {"x": x_opts, "y": y_opts},
                         {"compute": ["x"], "memory": ["y"]}, {"x": 0, "y": 0}, [])


def test_stage2_never_mixes_points():
    prob = _problem(X_OPTS, Y_OPTS)
    mixed, opt = brute_force(prob, consistent=False)
    assert mixed == 17 and (opt["x"].point, opt["y"].point) == ("t:0", "t:1")  # the old bug
    alloc, rep = solve_stage2(prob, Limits(10, 2))
    assert rep.status == "OPTIMAL" and alloc is not None
    assert alloc.period == brute_force(prob, consistent=True)[0] == 18  # apart, full GPU
    x, y = alloc.choice["x"], alloc.choice["y"]
    sx, sy, dx, dy = alloc.starts["x"], alloc.starts["y"], alloc.durations["x"], \
        alloc.durations["y"]
    overlap = any(sx + a * alloc.period < sy + dy + b * alloc.period
                  and sy + b * alloc.period < sx + dx + a * alloc.period
                  for a in (0, 1) for b in (0, 1))
    assert not overlap or compatible(x, y)


def test_stage2_pairs_the_sides_of_one_point_when_it_pays():
    good_x = AllocOption(300, 0.8, "cta_bound", 132, point="t:2", side="compute")
    good_y = AllocOption(700, 0.9, "cta_bound", 90, point="t:2", side="other")
    green_x = AllocOption(600, 0.6, "green_ctx", 80, point="g:0", side="compute")
    green_y = AllocOption(400, 0.8, "green_ctx", 52, point="g:0", side="other")
    prob = _problem([*X_OPTS, good_x, green_x], [*Y_OPTS, good_y, green_y])
    alloc, rep = solve_stage2(prob, Limits(10, 2))
    assert rep.status == "OPTIMAL" and alloc is not None
    assert alloc.period == brute_force(prob, consistent=True)[0] == 13  # 10 / 0.8 beside 8 / 0.9
    assert {x: o.point for x, o in alloc.choice.items()} == {"x": "t:2", "y": "t:2"}
    # green_ctx mixes with green_ctx only: green x beside the cta_bound y is not measured
    prob = _problem([FULL, green_x], [FULL, good_y, green_y])
    alloc, _ = solve_stage2(prob, Limits(10, 2))
    assert alloc is not None and alloc.period == brute_force(prob, consistent=True)[0] == 17
    assert {o.mechanism for o in alloc.choice.values()} == {"green_ctx"}


def test_alloc_options_keep_each_non_partition_point_with_its_identity():
    prof = load_profile("nanosched/profiler/profiles/llama3-8b-tp1-h100.json")
    comp, mem = alloc_options(prof, "compute"), alloc_options(prof, "memory")
    np_c = {o.point for o in comp if o.mechanism in ("cta_bound", "stream_priority")}
    np_m = {o.point for o in mem if o.mechanism in ("cta_bound", "stream_priority")}
    assert np_c == np_m and np_c  # both sides of every kept point
    assert all(o.side == "compute" for o in comp if o.point)
    assert all(o.side == "other" for o in mem if o.point)
    assert len(np_c) >= 2
    shared = ("cta_bound", "stream_priority")
    ug = next(o for o in comp if o.point and o.mechanism in shared)
    attn = next(o for o in mem if o.point and o.point != ug.point and o.mechanism in shared)
    assert not compatible(ug, attn)  # two sides of two different measured points
    assert compatible(ug, next(o for o in mem if o.point == ug.point))


def _overlap(spans, x: str, y: str) -> bool:
    return any(a < b2 and a2 < b for (i, _), (a, b) in spans.items() if i == x
               for (j, _), (a2, b2) in spans.items() if j == y)


def _mixed(s: Schedule):
    """The schedule with an overlapping GEMM / attention pair given sides of two points."""
    durs = {n.id: nano_time_us(small_profile(), n, s.batch) for n in s.nano_ops}
    spans = replay(s, durs, 4)
    pair = next((x, y) for x in s.nano_ops for y in s.nano_ops
                if x.resource == "compute" and y.resource == "memory"
                and _overlap(spans, x.id, y.id))
    x, y = pair
    ax = dataclasses.replace(x.alloc, mechanism="cta_bound", point="memory:12", side="compute")
    ay = dataclasses.replace(y.alloc, mechanism="stream_priority", point="memory:11",
                             side="other")
    ops = tuple(dataclasses.replace(n, alloc=ax) if n.id == x.id else
                dataclasses.replace(n, alloc=ay) if n.id == y.id else n for n in s.nano_ops)
    return dataclasses.replace(s, nano_ops=ops), x.id, y.id, durs


def test_check_schedule_rejects_mixed_points():
    s = small_schedule()
    check_schedule(s, small_profile())
    bad, x, y, _ = _mixed(s)
    with pytest.raises(ScheduleError, match=r"'point consistency' violated at .*never measured "
                       r"together") as err:
        check_schedule(bad, small_profile())
    msg = str(err.value)
    # the first violation found names an altered nano-op and its point (the other side may
    # be a green neighbour of it rather than its altered partner)
    assert (x in msg or y in msg) and ("memory:12" in msg or "memory:11" in msg)
    # the two sides of one point may overlap (others beside them still may not)
    same = dataclasses.replace(bad, nano_ops=tuple(
        dataclasses.replace(n, alloc=dataclasses.replace(n.alloc, point="memory:12"))
        if n.id == y else n for n in bad.nano_ops))
    try:
        check_points(same)
    except ScheduleError as exc:
        assert not (f"{x}'s" in str(exc) and f"{y}'s" in str(exc)), exc


def test_old_schedules_without_point_identity_are_matched_by_mechanism_and_r():
    s, x, y, _ = _mixed(small_schedule())
    old = dataclasses.replace(s, nano_ops=tuple(
        dataclasses.replace(n, alloc=dataclasses.replace(n.alloc, point="", side=""))
        for n in s.nano_ops))
    with pytest.raises(ScheduleError, match="'point consistency' violated"):
        check_points(old)


def test_simulator_delays_an_incompatible_start():
    a = Alloc(0.03, 0.6, "cta_bound", 132, point="q0", side="compute")
    b = Alloc(0.905, 0.93, "stream_priority", 132, point="q1", side="other")
    mate = Alloc(0.97, 0.33, "cta_bound", 128, point="q0", side="other")
    placed = [(0.0, 10.0, a.share, a)]
    assert _fits(placed, 2.0, 5.0, b.share, b) == 10.0  # waits for the end
    assert _fits(placed, 2.0, 5.0, mate.share, mate) is None  # the measured pair runs at once
    s = small_schedule()
    bad, x, y, durs = _mixed(s)
    assert _overlap(replay(s, durs, 4), x, y)
    assert not _overlap(replay(bad, durs, 4), x, y)


def test_a_gemm_nano_op_is_priced_on_its_own_measured_shape():
    """A compute nano-op of a GEMM the profile paired at its own shape gets that shape's
    green-context points (nearest measured token count), not the folded curve; other ops and
    a call without the op keep the folded table."""
    from nanosched.autosearch.durations import shape_points
    from nanosched.profiler.catalog import load_named_profile

    prof = load_named_profile("llama3-8b-tp1-h100")
    folded = {o.units: o.p for o in alloc_options(prof, "compute") if o.mechanism == "green_ctx"}
    own = {o.units: o for o in alloc_options(prof, "compute", "d", 256)
           if o.mechanism == "green_ctx"}
    pts = shape_points(prof, "memory", "d", 256)
    assert pts and {p.tokens for p in pts} == {384}  # the nearest measured count
    assert set(own) == {p.compute_sms for p in pts}
    for p in pts:
        assert own[p.compute_sms].p == max(q.p_compute for q in pts
                                          if q.compute_sms == p.compute_sms)
        assert own[p.compute_sms].point.startswith("memory@d:384:")
    ug = {o.units: o.p for o in alloc_options(prof, "compute", "ug", 1024)
          if o.mechanism == "green_ctx"}
    own_ug = shape_points(prof, "memory", "ug", 1024)
    assert own_ug and ug == {p.compute_sms: max(q.p_compute for q in own_ug
                                                if q.compute_sms == p.compute_sms)
                             for p in own_ug}
    assert ug != {u: folded[u] for u in ug if u in folded}  # not the folded curve
    assert {o.units: o.p for o in alloc_options(prof, "compute", "attn_prefill", 256)
            if o.mechanism == "green_ctx"} == folded


def test_a_memory_nano_op_on_a_partition_gets_the_p_measured_beside_the_fastest_gemm():
    """On a green-context split the attention's P depends on the GEMM beside it: the memory
    option carries the P_other of the point whose P_compute is best at that split (the GEMM
    the search runs there), not the best P_other (measured beside a slower GEMM); on a split
    or a CTA bound never more than the op's own speed alone on that many SMs."""
    from nanosched.profiler.format import RPPoint

    prof = dataclasses.replace(small_profile(), rp={"memory": (
        RPPoint(0.242, 0.78, 0.30, "green_ctx", 100, 32, "cublas"),
        RPPoint(0.242, 0.61, 0.37, "green_ctx", 100, 32, "cublaslt"),
        RPPoint(0.242, 0.55, 0.45, "cta_bound", 100, 32, "cublaslt"))})
    green = [o for o in alloc_options(prof, "memory") if o.mechanism == "green_ctx"]
    assert [(o.share, o.p) for o in green] == [(242, 0.61)]
    comp = [o for o in alloc_options(prof, "compute") if o.mechanism == "green_ctx"]
    assert [(o.share, o.p) for o in comp] == [(758, 0.37)]
    # `act` alone on 32 of 132 SMs runs at row(132) / row(32) of the profile: the cap
    act = [o for o in alloc_options(prof, "other", "act", 256) if o.mechanism != "full"]
    alone = prof.kernel_time_us("act", 256) / prof.kernel_time_us("act", 256, 32)
    assert alone < 0.55
    assert [(o.mechanism, o.p) for o in act] == [("green_ctx", pytest.approx(alone)),
                                                 ("cta_bound", pytest.approx(alone))]
    bound = next(o for o in alloc_options(prof, "memory") if o.mechanism == "cta_bound")
    assert bound.p == 0.55  # without an op, the point's own P


def test_two_hbm_streams_on_partitions_never_run_at_once():
    """The attention and an elementwise op, each on half the GPU at 0.9 of its speed alone,
    would read 1.8 of HBM: both are the memory table's other side, never measured together."""
    attn = AllocOption(500, 0.9, "green_ctx", 66, point="memory:0", side="other")
    norm = AllocOption(500, 0.9, "green_ctx", 66, point="memory:1", side="other")
    gemm = AllocOption(500, 0.6, "green_ctx", 66, point="memory@ug:640:0", side="compute")
    allreduce = AllocOption(500, 0.9, "green_ctx", 66, point="network:0", side="other")
    assert not compatible(attn, norm) and not compatible(norm, attn)
    assert compatible(attn, gemm) and compatible(attn, allreduce)
    legacy = dataclasses.replace(norm, point="")  # written before allocations named a point
    assert compatible(attn, legacy)
    prob = Stage2Problem({"x": 10.0, "y": 8.0}, {"x": [FULL, attn], "y": [FULL, norm]},
                         {"memory": ["x"], "other": ["y"]}, {"x": 0, "y": 0}, [])
    assert brute_force(prob, consistent=False)[0] == 12  # side by side: 10 / 0.9, 8 / 0.9
    alloc, rep = solve_stage2(prob, Limits(10, 2))
    assert rep.status == "OPTIMAL" and alloc is not None
    assert alloc.period == brute_force(prob, consistent=True)[0] == 18  # one after the other
