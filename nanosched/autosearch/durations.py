"""Nano-op durations and allocation options read from a profile; shared by search and checks.

Time is integer ticks of 1 us inside the solvers (`TICKS_PER_US`). A share is the part of
the GPU, in per-mille, that a nano-op is given (R for a memory or network kernel, 1 - R for the
compute kernel beside it); its duration is t_alone / P with P from the profile's R->P table,
and on the whole GPU P = 1 / F, F the profile's settled factor of the op in a forward of the
batch's rows (its forward table; 1 without one).

More in docs/search.md, module notes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum
from typing import Protocol

from nanosched.errors import ProfileError
from nanosched.models import ops as optable
from nanosched.models.ops import COMPUTE, NETWORK
from nanosched.profiler.format import Profile, RPPoint
from nanosched.profiler.interference import P_MAX

TICKS_PER_US = 1
FULL_SHARE = 1000


class _Valued(str, Enum):
    """A member compares, hashes, formats and serialises as its value: the profile's and the
    schedule's strings."""

    def __str__(self) -> str:
        return str(self.value)


class Mechanism(_Valued):
    """How a nano-op shares the GPU."""

    FULL = "full"
    GREEN_CTX = "green_ctx"
    CTA_BOUND = "cta_bound"
    STREAM_PRIORITY = "stream_priority"

    @property
    def paired(self) -> bool:
        """A non-partition point (both kernels may use every SM, R is nominal): it may run
        beside nothing but the other side of its own point."""
        return self not in (Mechanism.FULL, Mechanism.GREEN_CTX)


class Side(_Valued):
    """Which kernel of a measured R->P pair an option runs as."""

    COMPUTE = "compute"
    OTHER = "other"

    @property
    def mate(self) -> Side:
        """The other kernel of the pair."""
        return Side.OTHER if self is Side.COMPUTE else Side.COMPUTE


PARTITION = Mechanism.GREEN_CTX  # the one mechanism whose shares are disjoint SM fractions
SIDES = (Side.COMPUTE, Side.OTHER)


def to_ticks(us: float) -> int:
    return max(1, math.ceil(us * TICKS_PER_US - 1e-9))


def op_context(op: str, decode_context: float, prompt_len: float) -> float | None:
    """The context an attention op's profile rows are keyed by: the decode tokens' mean KV
    context, or the prompt length of prefill chunks (None for non-attention ops)."""
    return {"decode": decode_context, "prefill": prompt_len}.get(optable.domain_of(op))


def tick_table(profile: Profile, op: str, max_tokens: int, context: float | None,
               quantum: int = 128, settled: bool = True) -> list[int]:
    """Ticks of `op` alone on the whole GPU at 0, 128, ..., max_tokens tokens (index = tokens
    / 128) inside a forward of `max_tokens` rows: its rows times the profile's settled factor
    there (`Profile.settled_factor`), or its bare rows when not `settled`."""
    f = profile.settled_factor(op, max_tokens) if settled else 1.0
    return [0] + [to_ticks(profile.kernel_time_us(op, q * quantum, None, context) * f)
                  for q in range(1, max_tokens // quantum + 1)]


@dataclass(frozen=True)
class AllocOption:
    """One way to run a nano-op: its share of the GPU and the P it then reaches."""

    share: int  # per-mille of the GPU
    p: float  # performance relative to running alone
    mechanism: Mechanism  # a plain string is converted
    units: int  # SMs (green_ctx, full) or CTAs (cta_bound)
    impl: str = "default"
    table: str = ""  # R->P table the point came from ("" for full)
    point: str = ""  # "table:index" of the R->P point in profile.rp ("" for full)
    side: Side | None = None  # which kernel of the measured pair (None for full; "" accepted)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mechanism", Mechanism(self.mechanism))
        object.__setattr__(self, "side", Side(self.side) if self.side else None)

    @property
    def paired(self) -> bool:
        """Of a non-partition point: runs beside nothing but its point's other side."""
        return self.mechanism.paired

    def ticks(self, alone_us: float) -> int:
        """Ticks of a nano-op that takes `alone_us` alone, under this option: t / P."""
        return to_ticks(alone_us / self.p)


class PointAlloc(Protocol):
    """What compatibility looks at: an AllocOption, or a schedule's Alloc."""

    @property
    def mechanism(self) -> str: ...
    @property
    def point(self) -> str: ...
    @property
    def side(self) -> str | None: ...


def compatible(a: PointAlloc, b: PointAlloc) -> bool:
    """True when allocations `a` and `b` (anything with `mechanism`, `point`, `side`: an
    AllocOption or a schedule's Alloc) were measured together, so may run at once."""
    ma, mb = a.mechanism, b.mechanism
    if ma == Mechanism.FULL or mb == Mechanism.FULL:
        return False
    if ma == PARTITION or mb == PARTITION:
        return ma == mb and not shares_hbm(a, b)
    pa, pb = a.point, b.point
    return bool(pa) and pa == pb and a.side != b.side


def point_table(point: str) -> str:
    """The R->P table a point names ("memory:3", "memory@ug:640:1" -> "memory"; "" for none)."""
    return point.split(":", 1)[0].split("@", 1)[0]


def hbm_stream(a: PointAlloc) -> bool:
    """True when `a` is the other side of the memory table: a memory-bound kernel (attention,
    elementwise) priced as it ran beside a GEMM. An allocation without a point (schedules
    written before allocations carried one) is not judged."""
    return a.side == Side.OTHER and point_table(a.point) == "memory"


def shares_hbm(a: PointAlloc, b: PointAlloc) -> bool:
    """True when `a` and `b` are both HBM streams (`hbm_stream`). No such pair was measured,
    and both draw on HBM: on two halves of the GPU the attention and a norm would each be
    priced at 0.87 of their speed alone, 1.74 of HBM between them."""
    return hbm_stream(a) and hbm_stream(b)


def describe(a: PointAlloc) -> str:
    """An allocation's mechanism, point and side, for messages."""
    mech = a.mechanism
    if mech == Mechanism.FULL:
        return "the full GPU"
    where = f" {a.point}" if a.point else ""
    return f"{mech} point{where} ({a.side or '?'} side)"


def _dominated(pt: RPPoint, i: int, points: tuple[RPPoint, ...]) -> bool:
    """A non-partition point is useless when another pairing of the same table is at least as
    fast on both sides: another point, or a green compute share beside a green other share
    that fit together. (Its two sides only ever run together, filling the GPU.)"""
    for j, q in enumerate(points):
        if j == i or q.p_compute < pt.p_compute or q.p_other < pt.p_other:
            continue
        if q.mechanism == PARTITION or (q.p_compute, q.p_other) != (pt.p_compute, pt.p_other) \
                or j < i:
            return True
    green = [q for q in points if q.mechanism == PARTITION]
    return any(c.p_compute >= pt.p_compute and o.p_other >= pt.p_other
               and round(o.r * FULL_SHARE) <= round(c.r * FULL_SHARE)
               for c in green for o in green)


def _capped(profile: Profile, opt: AllocOption, op: str, tokens: int,
            context: float | None) -> AllocOption:
    """`opt` with its P at most `op`'s speed alone on its SMs or CTAs (`alloc_options`)."""
    if opt.units >= profile.identity.num_sms:
        return opt
    try:
        alone = (profile.kernel_time_us(op, tokens, None, context)
                 / profile.kernel_time_us(op, tokens, opt.units, context))
    except ProfileError:
        return opt
    return opt if opt.p <= alone else replace(opt, p=alone)


def shape_points(profile: Profile, table: str, op: str, tokens: int) -> list[RPPoint]:
    """The green-context points the profile measured for GEMM `op` at the measured token count
    nearest `tokens` (`Profile.rp_shapes`), or [] when it kept none for `op`."""
    own = [p for p in profile.rp_shapes.get(table, ())
           if p.compute_op == op and p.mechanism == PARTITION]
    if not own:
        return []
    near = min({p.tokens for p in own}, key=lambda t: (abs(t - tokens), t))
    return [p for p in own if p.tokens == near]


def alloc_options(profile: Profile, resource: str, op: str | None = None,
                  tokens: int | None = None, batch_tokens: int | None = None,
                  context: float | None = None) -> list[AllocOption]:
    """Full GPU, plus the R->P points of the class's table (both tables for compute).

    The full-GPU option's P is 1 / F, F the profile's settled factor of `op` in a forward of
    `batch_tokens` rows (`Profile.settled_factor`; 1 without them): an op alone on the whole
    GPU inside a forward runs at F times its row, as the pairs' P already price their kernels
    at the clock a forward settles at.

    `green_ctx` points are kept one per share: for compute the best P_compute, for memory the
    P_other of the point with the best P_compute at that split (not the best P_other: that was
    measured beside a slower GEMM, and mixing the two sides' best predicted pipelines that ran
    10% slower on the GPU; docs/notebook/2026-11-26-forward-table.md). For a compute
    nano-op of GEMM `op` over `tokens` tokens whose shape the profile measured on its own
    (`shape_points`), its green-context options are that shape's points instead of the folded
    table's: the folded curve mixes every GEMM's pairs and overstates the small GEMMs (`o`,
    `d`) beside the attention (docs/notebook/2026-11-24-schedule-sets-end-to-end.md). A
    non-partition point is kept as itself (its identity decides what it may overlap) unless
    another pairing of its table is at least as fast on both sides (`_dominated`); both sides
    drop together.

    A memory or elementwise nano-op of `op` over `tokens` rows (at `context`) on a partition
    or a CTA bound runs no faster beside a GEMM than alone there: its P is at most its row on
    all SMs over its row on that many SMs or CTAs, where the profile has both (the attention's
    points would otherwise price `act` on 16 SMs at 0.35 where it reaches 0.19-0.22 alone).
    """
    factor = profile.settled_factor(op, batch_tokens) if op and batch_tokens else 1.0
    full = AllocOption(FULL_SHARE, min(P_MAX, 1 / factor), Mechanism.FULL,
                       profile.identity.num_sms)
    green: dict[int, AllocOption] = {}
    rank: dict[int, tuple[float, float]] = {}  # share -> (P_compute, -P) of the kept point
    points: list[AllocOption] = []
    if resource == COMPUTE:
        tables = sorted(profile.rp)
    else:
        tables = ["network" if resource == NETWORK else "memory"]
    for table in tables:
        pts = profile.rp.get(table, ())
        for i, pt in enumerate(pts):
            if resource == COMPUTE:
                opt = AllocOption(FULL_SHARE - round(pt.r * FULL_SHARE), pt.p_compute,
                                  pt.mechanism, pt.compute_sms, pt.compute_impl, table,
                                  f"{table}:{i}", Side.COMPUTE)
            else:
                opt = AllocOption(round(pt.r * FULL_SHARE), pt.p_other, pt.mechanism,
                                  pt.other_sms, pt.other_impl or "default", table,
                                  f"{table}:{i}", Side.OTHER)
            if pt.mechanism != PARTITION:
                if not _dominated(pt, i, pts):
                    points.append(opt)
            else:
                key = (pt.p_compute, -opt.p) if resource != COMPUTE else (opt.p, 0.0)
                if opt.share not in green or rank[opt.share] < key:
                    green[opt.share], rank[opt.share] = opt, key
    if resource not in (COMPUTE, NETWORK) and op is not None and tokens is not None:
        green = {share: _capped(profile, o, op, tokens, context) for share, o in green.items()}
        points = [_capped(profile, o, op, tokens, context) for o in points]
    if resource == COMPUTE and op is not None and tokens is not None:
        own: dict[int, AllocOption] = {}
        for table in tables:
            for i, pt in enumerate(shape_points(profile, table, op, tokens)):
                opt = AllocOption(FULL_SHARE - round(pt.r * FULL_SHARE), pt.p_compute,
                                  pt.mechanism, pt.compute_sms, pt.compute_impl, table,
                                  f"{table}@{op}:{pt.tokens}:{i}", Side.COMPUTE)
                if opt.share not in own or own[opt.share].p < opt.p:
                    own[opt.share] = opt
        if own:
            green = own
    out = [full, *green.values(), *points]
    return sorted(out, key=lambda o: (-o.share, o.mechanism != PARTITION, o.point))
