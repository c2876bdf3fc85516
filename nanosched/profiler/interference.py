"""From raw co-run pairs to R->P tables (NanoFlow section 4.1.1, Table 3). Pure Python.

For each shape (compute op, tokens, context) the pairs are Pareto-filtered: a pair is dropped
when another pair of the same shape has both a higher P_compute and a higher P_other. A
realisation (mechanism, compute implementation, SMs or CTAs of each side) that is Pareto-best in
at least one shape is folded over all shapes where it was measured: mean R, P_other and
P_compute, and `std_rel` = standard deviation / mean of P_other. The folded points are filtered
again, giving one table per class. `fit` is the largest `std_rel` of the table; NanoFlow found
within 5%. Where the fit is worse than `FIT_LIMIT`, the per-shape Pareto points are kept too.

More in docs/profiler.md, module notes.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nanosched.profiler.format import PairRow, RPPoint

FIT_LIMIT = 0.05
R_MIN, R_MAX = 0.01, 0.99
P_MAX = 1.5

# (op, tokens, context) -> the profile's time of that op alone on the whole GPU, or None
AloneTime = Callable[[str, int, int], "float | None"]


def r_of(pair: PairRow, num_sms: int) -> float:
    """Share of the GPU given to the non-compute kernel (see format.py, `rp`)."""
    if pair.mechanism in ("green_ctx", "cta_bound"):
        r = min(pair.other_sms, num_sms) / num_sms
    else:  # nothing bounds it: NanoFlow's GEMM-centric proxy
        r = 1 - pair.p_compute
    return min(max(r, R_MIN), R_MAX)


def _p(value: float) -> float:
    return min(max(value, 1e-3), P_MAX)


def pair_ps(pair: PairRow, alone: AloneTime | None = None) -> tuple[float, float]:
    """(P_compute, P_other) of a pair against the `alone` times of its shapes (docs/profiler.md),
    each side against the pair's own alone time where `alone` has no row."""
    tc = alone(pair.compute_op, pair.tokens, 0) if alone else None
    to = alone(pair.other_op, pair.tokens, pair.context) if alone else None
    return (tc / pair.compute_us if tc else pair.p_compute,
            to / pair.other_us if to else pair.p_other)


def point_of(pair: PairRow, num_sms: int, per_shape: bool = False,
             alone: AloneTime | None = None) -> RPPoint:
    shape = {"compute_op": pair.compute_op, "tokens": pair.tokens,
             "context": pair.context} if per_shape else {}
    p_compute, p_other = pair_ps(pair, alone)
    return RPPoint(r=r_of(pair, num_sms), p_other=_p(p_other),
                   p_compute=_p(p_compute), mechanism=pair.mechanism,
                   compute_sms=pair.compute_sms, other_sms=pair.other_sms,
                   compute_impl=pair.compute_impl, clock_mhz=pair.clock_mhz,
                   other_impl=pair.other_impl, **shape)


def pareto(points: Iterable[RPPoint]) -> list[RPPoint]:
    """Points not dominated in (p_compute, p_other), sorted by R; ties keep the first."""
    pts = list(points)
    keep = []
    for i, p in enumerate(pts):
        dominated = any(
            q.p_compute >= p.p_compute and q.p_other >= p.p_other and
            (q.p_compute > p.p_compute or q.p_other > p.p_other or j < i)
            for j, q in enumerate(pts) if j != i)
        if not dominated:
            keep.append(p)
    return sorted(keep, key=lambda p: (p.r, -p.p_other))


def _realisation(p: RPPoint) -> tuple[str, str, int, int, str]:
    return (p.mechanism, p.compute_impl, p.compute_sms, p.other_sms, p.other_impl)


@dataclass(frozen=True)
class RPTable:
    points: tuple[RPPoint, ...]  # folded over shapes, Pareto-filtered
    per_shape: tuple[RPPoint, ...]  # Pareto points of each shape
    fit: float  # largest std_rel of p_other among `points`
    num_shapes: int

    @property
    def fits(self) -> bool:
        return self.fit <= FIT_LIMIT


def derive_rp(pairs: Iterable[PairRow], num_sms: int, alone: AloneTime | None = None
              ) -> RPTable:
    """The R->P table of one class from its raw pairs, P against `alone` (docs/profiler.md;
    None: against each pair's own alone times)."""
    shapes: dict[tuple[str, int, int], list[RPPoint]] = defaultdict(list)
    for pair in pairs:
        shapes[(pair.compute_op, pair.tokens, pair.context)].append(
            point_of(pair, num_sms, per_shape=True, alone=alone))
    front = {shape: pareto(pts) for shape, pts in shapes.items()}
    useful = {_realisation(p) for pts in front.values() for p in pts}
    folded = []
    for key in sorted(useful):
        same = [p for pts in shapes.values() for p in pts if _realisation(p) == key]
        p_other = [p.p_other for p in same]
        mean_other = statistics.fmean(p_other)
        std = statistics.pstdev(p_other) / mean_other if len(same) > 1 else 0.0
        clocks = [p.clock_mhz for p in same if p.clock_mhz is not None]
        folded.append(RPPoint(
            r=min(max(statistics.fmean(p.r for p in same), R_MIN), R_MAX), p_other=mean_other,
            p_compute=statistics.fmean(p.p_compute for p in same), mechanism=key[0],
            compute_sms=key[2], other_sms=key[3], compute_impl=key[1], other_impl=key[4],
            std_rel=std,
            clock_mhz=round(statistics.fmean(clocks), 1) if clocks else None))
    table = pareto(folded)
    fit = max((p.std_rel for p in table), default=0.0)
    per_shape = tuple(p for shape in sorted(front) for p in front[shape])
    return RPTable(tuple(table), per_shape, fit, len(shapes))
