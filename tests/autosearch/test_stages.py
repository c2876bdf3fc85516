"""Stage I and stage II against brute force on instances small enough to enumerate."""

import functools
import itertools

import pytest
from test_point_consistency import brute_force

from nanosched.autosearch.cpsat import Limits
from nanosched.autosearch.durations import AllocOption
from nanosched.autosearch.opgraph import Edge, GraphOp, OpGraph, TokenMix, expand, nano_deps
from nanosched.autosearch.periodic import min_period
from nanosched.autosearch.stage1 import solve_stage1
from nanosched.autosearch.stage1_bounds import min_split_ticks
from nanosched.autosearch.stage1_model import Stage1Problem
from nanosched.autosearch.stage2 import Stage2Problem, solve_stage2
from nanosched.errors import ConfigError

# A (compute) -> M (memory) -> C (compute) -> next layer's A
GRAPH = OpGraph((GraphOp("a", "compute"), GraphOp("m", "memory"), GraphOp("c", "compute")),
                (Edge("a", "m"), Edge("m", "c"), Edge("c", "a", 1)))
TABLES = {"a": [0, 5, 8, 11], "m": [0, 9, 12, 16], "c": [0, 4, 7, 9]}


def brute_force_stage1(batch: int, fixed: dict[str, int] | None = None) -> int:
    """Least period over every split (ops in `fixed` cut only there), per-stream order and
    layer offsets."""
    return _brute_force_stage1(batch, tuple(sorted((fixed or {}).items())))


@functools.cache  # four tests ask for the optimum at 384 tokens (a second of enumeration)
def _brute_force_stage1(batch: int, fixed_items: tuple[tuple[str, int], ...]) -> int:
    fixed = dict(fixed_items)
    mix, q, best = TokenMix(batch, 0, batch), batch // 128, 10**9
    cuts = {op: [fixed[op]] if op in fixed else range(1, q) for op in "amc"}
    for ca, cm, cc in itertools.product(cuts["a"], cuts["m"], cuts["c"]):
        split = {op: [(0, 128 * c), (128 * c, batch)]
                 for op, c in zip("amc", (ca, cm, cc), strict=True)}
        nanos = expand(GRAPH, split, mix, {})
        durs = {n.id: TABLES[n.op][n.work_tokens // 128] for n in nanos}
        deps = [(x, y, s) for y, ds in nano_deps(GRAPH, nanos, mix, {}).items() for x, s, _ in ds]
        compute = [n.id for n in nanos if n.resource == "compute"]
        memory = [n.id for n in nanos if n.resource == "memory"]
        for corder in itertools.permutations(compute):
            for morder in itertools.permutations(memory):
                for ks in itertools.product((0, 1), repeat=len(nanos)):
                    offsets = dict(zip(durs, ks, strict=True))
                    found = min_period(durs, {"compute": list(corder), "memory": list(morder)},
                                       deps, offsets)
                    if found:
                        best = min(best, found[0])
    return best


def test_stage1_matches_brute_force():
    for batch in (256, 384):
        prob = Stage1Problem(GRAPH, TokenMix(batch, 0, batch), TABLES, {"a": 2, "m": 2, "c": 2})
        st, rep = solve_stage1(prob, Limits(10, 2))
        assert rep.status == "OPTIMAL"
        assert st is not None and st.period == brute_force_stage1(batch)


def test_stage1_out_of_time_keeps_the_heuristic_with_a_finite_bound(monkeypatch):
    """No CP-SAT solve finishing in time (a loaded machine, a short --time-limit) keeps the
    heuristic structure, reported with R's bound: a schedule refuses NaN in its stages."""
    import math

    from nanosched.autosearch import stage1
    from nanosched.schedules.format import StageReport

    def nothing(model, stage, limits, progress, **kw):
        return None, StageReport(stage, "UNKNOWN", math.nan, math.nan, math.nan, 0.01,
                                 limits.time_limit_s, limits.num_workers), False

    monkeypatch.setattr(stage1, "solve", nothing)
    prob = Stage1Problem(GRAPH, TokenMix(384, 0, 384), TABLES, {"a": 2, "m": 2, "c": 2})
    st, rep = solve_stage1(prob, Limits(1, 1))
    assert st is not None and rep.status == "HINT"
    assert rep.objective_us * stage1.TICKS_PER_US == st.period
    assert math.isfinite(rep.bound_us) and math.isfinite(rep.gap)
    assert 0 < rep.bound_us <= rep.objective_us and 0 <= rep.gap < 1


def test_stage1_with_fixed_cuts_matches_brute_force():
    """Fixed cuts: the split is the one given, and the period is the best over the free ops'
    cuts, orders and offsets (here above the free optimum: cutting m at 1 of 3 quanta)."""
    prob = Stage1Problem(GRAPH, TokenMix(384, 0, 384), TABLES, {"a": 2, "m": 2, "c": 2},
                         fixed_cuts={"m": (1,), "c": (2,)})
    st, rep = solve_stage1(prob, Limits(10, 2))
    assert rep.status == "OPTIMAL" and st is not None
    assert st.split["m"] == [(0, 128), (128, 384)] and st.split["c"] == [(0, 256), (256, 384)]
    assert st.period == brute_force_stage1(384, {"m": 1, "c": 2}) > brute_force_stage1(384)


def test_stage1_refuses_fixed_cuts_that_do_not_fit():
    for bad in ((0,), (3,), (2, 1), (1, 1)):
        counts = {"a": 2, "m": len(bad) + 1, "c": 2}
        with pytest.raises(ConfigError, match="fixed cuts"):
            Stage1Problem(GRAPH, TokenMix(384, 0, 384), TABLES, counts, fixed_cuts={"m": bad})
    with pytest.raises(ConfigError, match="fixed cuts"):  # 3 nano-ops need 2 cuts
        Stage1Problem(GRAPH, TokenMix(384, 0, 384), TABLES, {"a": 2, "m": 3, "c": 2},
                      fixed_cuts={"m": (1,)})


def test_min_split_is_the_cheapest_split():
    table = [0, 5, 8, 11, 15]
    assert min_split_ticks(table, 2) == min(table[k] + table[4 - k] for k in range(1, 4))
    assert min_split_ticks(table, 4) == 20


def test_stage2_matches_brute_force():
    full = AllocOption(1000, 1.0, "full", 132)
    options = {"x": [full, AllocOption(600, 0.6, "green_ctx", 80)],
               "y": [full, AllocOption(400, 0.8, "green_ctx", 52),
                     AllocOption(200, 0.3, "green_ctx", 26)]}
    for deps in ([], [("x", "y", 1)], [("x", "y", 0)]):
        prob = Stage2Problem({"x": 10.0, "y": 8.0}, options, {"compute": ["x"], "memory": ["y"]},
                             {"x": 0, "y": 0}, deps)
        alloc, rep = solve_stage2(prob, Limits(10, 2))
        assert rep.status == "OPTIMAL" and alloc is not None
        assert alloc.period == brute_force(prob, consistent=False)[0]
    assert alloc.period == 18  # x then y, each alone: overlap cannot pay within one layer


def test_stage2_overlaps_when_it_pays():
    full = AllocOption(1000, 1.0, "full", 132)
    prob = Stage2Problem({"x": 10.0, "y": 8.0},
                         {"x": [full, AllocOption(600, 0.6, "green_ctx", 80)],
                          "y": [full, AllocOption(400, 0.8, "green_ctx", 52)]},
                         {"compute": ["x"], "memory": ["y"]}, {"x": 0, "y": 0}, [])
    alloc, _ = solve_stage2(prob, Limits(10, 2))
    assert alloc is not None and alloc.period == 17  # 10 / 0.6 beside 8 / 0.8
    assert {x: o.share for x, o in alloc.choice.items()} == {"x": 600, "y": 400}


def test_stage2_out_of_time_keeps_the_sequential_placement_with_a_finite_bound(monkeypatch):
    """No solve finding anything in its time keeps the all-sequential hint (feasible, every
    nano-op on the whole GPU), with a bound no higher than the true optimum."""
    import math

    from nanosched.autosearch import stage2
    from nanosched.schedules.format import StageReport

    def nothing(model, stage, limits, progress, **kw):
        return None, StageReport(stage, "UNKNOWN", math.nan, math.nan, math.nan, 0.01,
                                 limits.time_limit_s, limits.num_workers), False

    full = AllocOption(1000, 1.0, "full", 132)
    options = {"x": [full, AllocOption(600, 0.6, "green_ctx", 80)],
               "y": [full, AllocOption(400, 0.8, "green_ctx", 52)]}
    for deps in ([], [("x", "y", 0)]):
        prob = Stage2Problem({"x": 10.0, "y": 8.0}, options,
                             {"compute": ["x"], "memory": ["y"]}, {"x": 0, "y": 0}, deps)
        best = brute_force(prob, consistent=False)[0]
        monkeypatch.setattr(stage2, "solve", nothing)
        alloc, rep = solve_stage2(prob, Limits(1, 1))
        monkeypatch.undo()
        assert alloc is not None and rep.status == "HINT" and "in time" in rep.note
        assert alloc.period == 18 and rep.objective_us == 18
        assert {o.share for o in alloc.choice.values()} == {1000}
        assert alloc.starts["x"] + alloc.durations["x"] <= alloc.starts["y"] or \
            alloc.starts["y"] + alloc.durations["y"] <= alloc.starts["x"]
        assert math.isfinite(rep.bound_us) and 0 < rep.bound_us <= best
        assert rep.gap == pytest.approx((18 - rep.bound_us) / 18)
    prob = Stage2Problem({"x": 10.0, "y": 8.0}, options, {"compute": ["x"], "memory": ["y"]},
                         {"x": 0, "y": 0}, [], max_period_ticks=17)
    monkeypatch.setattr(stage2, "solve", nothing)
    assert solve_stage2(prob, Limits(1, 1))[0] is None  # the hint breaks --max-period-us


def test_min_period_keeps_every_start_in_its_offset_period():
    # y (10 ticks, stream b) feeds x (1 tick, stream a), both of layer offset 0: x cannot
    # start before 10, so τ = 10 would put it in period 1; the least τ is 11.
    tau, starts = min_period({"x": 1, "y": 10}, {"a": ["x"], "b": ["y"]}, [("y", "x", 0)],
                             {"x": 0, "y": 0})
    assert tau == 11 and starts == {"x": 10, "y": 0}



def _two_op_problem(rng, x_opts: list[AllocOption], y_opts: list[AllocOption]) -> Stage2Problem:
    """x (compute) and y (memory) with these options, random durations and dependency."""
    from nanosched.autosearch.stage2 import paired_options

    deps = rng.choice([[], [("x", "y", 1)], [("y", "x", 1)]])
    return paired_options(Stage2Problem(
        {"x": float(rng.randint(5, 12)), "y": float(rng.randint(4, 10))},
        {"x": x_opts, "y": y_opts}, {"compute": ["x"], "memory": ["y"]},
        {"x": 0, "y": 0}, deps))


def _exclusive_sets_hold_at_the_optimum(prob: Stage2Problem) -> list:
    """Every exclusive-set row holds at the brute-force optimum, and stage II finds that
    optimum with the rows; returns the sets."""
    from nanosched.autosearch.stage2 import exclusive_sets

    tau, opt = brute_force(prob, consistent=True)
    sets = exclusive_sets(prob)
    for pick in sets:
        assert sum(prob.options[x][j].ticks(prob.alone[x]) for x, j in pick
                   if prob.options[x][j] == opt[x]) <= tau
    alloc, rep = solve_stage2(prob, Limits(10, 2))
    assert rep.status == "OPTIMAL" and alloc is not None and alloc.period == tau
    return sets


def test_exclusive_sets_hold_at_the_brute_force_optimum():
    """Every exclusive-set row Σ o_{x,j} d_{x,j} ≤ τ holds at the brute-force optimum (so the
    bound they give is never above it), and stage II with them still reaches that optimum."""
    import random

    from test_point_consistency import X_OPTS, Y_OPTS

    green_x = [AllocOption(600, 0.6, "green_ctx", 80), AllocOption(800, 0.9, "green_ctx", 100)]
    green_y = [AllocOption(400, 0.8, "green_ctx", 52), AllocOption(200, 0.5, "green_ctx", 26)]
    pair_x = AllocOption(300, 0.8, "cta_bound", 132, point="t:2", side="compute")
    pair_y = AllocOption(700, 0.9, "cta_bound", 90, point="t:2", side="other")
    rng = random.Random(5)
    for _ in range(6):
        x_opts = [X_OPTS[0], *rng.sample([*green_x, *X_OPTS[1:], pair_x], 3)]
        y_opts = [Y_OPTS[0], *rng.sample([*green_y, *Y_OPTS[1:], pair_y], 3)]
        assert _exclusive_sets_hold_at_the_optimum(_two_op_problem(rng, x_opts, y_opts))


def test_stage1_relaxation_is_never_above_the_brute_force_optimum():
    from nanosched.autosearch.stage1 import relaxation_bound
    from nanosched.autosearch.stage1_bounds import period_lower_bound

    for batch in (256, 384):
        prob = Stage1Problem(GRAPH, TokenMix(batch, 0, batch), TABLES, {"a": 2, "m": 2, "c": 2})
        bound = relaxation_bound(prob, None, Limits(10, 2))
        assert bound is not None and period_lower_bound(prob) <= bound
        assert bound <= brute_force_stage1(batch)


def test_mixed_side_exclusive_sets_hold_at_the_brute_force_optimum():
    """The rows that take one point's compute side and another point's other side (x on t:0
    compute beside y on t:1 other is never measured, so never runs) hold at the optimum."""
    import random

    full = AllocOption(1000, 1.0, "full", 132)
    rng = random.Random(11)
    mixed = 0
    for _ in range(8):
        x_opts, y_opts = [full], [full]
        for k in range(3):
            r = rng.choice((0.1, 0.3, 0.5, 0.7))
            x_opts.append(AllocOption(round(1000 * (1 - r)), rng.uniform(0.3, 0.95), "cta_bound",
                                      132, point=f"t:{k}", side="compute"))
            y_opts.append(AllocOption(round(1000 * r), rng.uniform(0.2, 0.95), "cta_bound",
                                      16, point=f"t:{k}", side="other"))
        prob = _two_op_problem(rng, x_opts, y_opts)
        for pick in _exclusive_sets_hold_at_the_optimum(prob):
            sides = {(prob.options[x][j].point, prob.options[x][j].side) for x, j in pick
                     if prob.options[x][j].point}
            mixed += len({side for _, side in sides}) == 2
    assert mixed > 0


def test_token_cycles_follow_the_layer_for_every_form():
    """Quantum j's cycle holds decode attention for decode tokens, prefill attention for the
    others, and both collective forms' ops (only the present one is counted)."""
    from nanosched.autosearch.opgraph import layer_graph
    from nanosched.autosearch.stage1_bounds import token_cycle_ops
    from nanosched.models.spec import load_spec

    graph = layer_graph(load_spec("llama3-70b"), 8)
    prob = Stage1Problem(graph, TokenMix(1024, 256, 512), {}, {})
    decode, prefill = token_cycle_ops(prob, 0), token_cycle_ops(prob, 7)
    assert decode is not None and prefill is not None
    assert "attn_decode" in decode and "attn_prefill" not in decode
    assert "attn_prefill" in prefill and "attn_decode" not in prefill
    assert {"ar_attn", "rs_attn", "ag_attn", "ar_ffn", "rs_ffn", "ag_ffn"} <= set(decode)
    assert token_cycle_ops(Stage1Problem(GRAPH, TokenMix(256, 0, 256), TABLES, {}), 1) \
        == ["a", "c", "m"]


def test_stage1_below_the_optimum_is_infeasible():
    """The proof solve's claim: the model with τ ≤ U is infeasible exactly when U is below the
    brute-force optimum (then U + 1 is a valid bound)."""
    from nanosched.autosearch.cpsat import solve
    from nanosched.autosearch.stage1_model import build_cp_model

    for batch in (256, 384):
        prob = Stage1Problem(GRAPH, TokenMix(batch, 0, batch), TABLES, {"a": 2, "m": 2, "c": 2})
        best = brute_force_stage1(batch)
        for cap, status in ((best - 1, "INFEASIBLE"), (best, "OPTIMAL")):
            m, _ = build_cp_model(prob, cap)
            _, rep, _ = solve(m, "proof", Limits(10, 2), None, subsolvers=("no_lp", "max_lp"))
            assert rep.status == status
