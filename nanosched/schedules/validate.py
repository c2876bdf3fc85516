"""Self-consistency of a schedule, checked on every load and save; pure Python.

Checked, in this order, naming the first problem (field + why): the batch mix; per op the
ranges cover the op's token domain without overlap (decode part for `attn_decode`, prefill part
for `attn_prefill`, [0, B) otherwise); every nano-op sits on one range, a known stream whose
class fits its op, with a valid allocation; issue orders are a permutation per stream; every
dependency exists, none waits on a nano-op issued in a later period, and the dependencies within
a period plus the stream orders are acyclic (else the replay deadlocks); the
allocations of nano-ops running at the same instant (predicted starts, layers repeating every
`solver_period_us`) sum to at most the whole GPU, and their green-context SMs to at most its SMs.

More in docs/search.md, module notes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from nanosched.constants import MAX_SMS, MECHANISMS, TOKEN_QUANTUM
from nanosched.errors import ScheduleError
from nanosched.models import ops as optable

if TYPE_CHECKING:
    from nanosched.schedules.format import NanoOp, Schedule

EPS_US = 1e-6
RESOURCES = optable.RESOURCE_CLASSES
DEP_KINDS = ("data", "prompt", "resource")
SIDE_VALUES = ("", "compute", "other")
FORMS = ("ar", "rs_ag")
MAX_DENSE_BATCH = 1 << 20  # tokens per iteration
MAX_TP = 1024
MAX_NANO_OPS_PER_OP = 64


def op_domain(op: str, dense_batch: int, num_decode: int) -> tuple[int, int]:
    domain = optable.domain_of(op)
    if domain == "decode":
        return 0, num_decode
    if domain == "prefill":
        return num_decode, dense_batch
    return 0, dense_batch


def validate(s: Schedule, where: str = "schedule") -> None:
    """Raise ScheduleError naming the first inconsistency of `s`."""
    validate_structure(s, where)
    check_capacity(s, where)


def validate_structure(s: Schedule, where: str = "schedule") -> None:
    """Everything `validate` checks except the timing-based GPU capacity."""
    _check_batch(s, where)
    _check_model(s, where)
    _check_streams(s, where)
    _check_prediction(s, where)
    _check_ranges(s, where)
    _check_nano_ops(s, where)
    _check_orders(s, where)
    _check_deps(s, where)


def _fail(where: str, field: str, why: str) -> ScheduleError:
    return ScheduleError(f"{where}: {field}: {why}")


def _check_batch(s: Schedule, where: str) -> None:
    b = s.batch
    if not 1 <= s.tp <= MAX_TP:
        raise _fail(where, "tp", f"must be in 1..{MAX_TP}, got {s.tp}")
    if not 1 <= s.num_sms <= MAX_SMS:
        raise _fail(where, "num_sms", f"must be in 1..{MAX_SMS}, got {s.num_sms}")
    if not TOKEN_QUANTUM <= b.dense_batch <= MAX_DENSE_BATCH or b.dense_batch % TOKEN_QUANTUM:
        raise _fail(where, "batch.dense_batch", f"must be a multiple of {TOKEN_QUANTUM} in "
                    f"{TOKEN_QUANTUM}..{MAX_DENSE_BATCH}, got {b.dense_batch}")
    if not 0 <= b.num_decode <= b.dense_batch or b.prompt_len < 1:
        raise _fail(where, "batch", f"num_decode {b.num_decode} must be in 0..{b.dense_batch} "
                    f"and prompt_len {b.prompt_len} positive")
    if b.decode_context < 0 or b.prefill_context < 0:
        raise _fail(where, "batch", "decode_context and prefill_context must be >= 0")
    bad_forms = {g: f for g, f in s.forms.items() if f not in FORMS}
    if bad_forms:
        raise _fail(where, "forms", f"{bad_forms} must each be one of {FORMS}")


POSITIVE_MODEL_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                         "intermediate_size", "vocab_size")


def _check_model(s: Schedule, where: str) -> None:
    """The model's shape: positive sizes, and as many layers as its parameter count holds (a
    hand-edited num_layers of 80 on a 2-layer model is refused, not replayed)."""
    m = s.model
    for name in POSITIVE_MODEL_FIELDS:
        v = m.get(name)
        if name in m and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise _fail(where, f"model.{name}", f"must be a positive integer, got {v!r}")
    params = m.get("params")
    if isinstance(params, int) and not isinstance(params, bool) and params > 0 and \
            all(isinstance(m.get(k), int) for k in POSITIVE_MODEL_FIELDS):
        h, d = m["hidden_size"], m["head_dim"]
        least = h * d * 2 * (m["num_heads"] + m["num_kv_heads"]) + 2 * h * m["intermediate_size"]
        if m["num_layers"] * least > params:
            raise _fail(where, "model.num_layers", f"{m['num_layers']} layers of at least "
                        f"{least:,} parameters each exceed the model's {params:,} (model.params)")


def _check_streams(s: Schedule, where: str) -> None:
    """Each stream runs its nano-ops on at least one unit (SMs or CTAs), each unit count
    positive."""
    for i, st in enumerate(s.streams):
        if not st.units or any(isinstance(u, bool) or not isinstance(u, int) or u < 1
                               for u in st.units):
            raise _fail(where, f"streams[{i}].units", f"must be a non-empty list of positive "
                        f"SM or CTA counts, got {list(st.units)}")


def _check_prediction(s: Schedule, where: str) -> None:
    """Times positive (show and the simulator divide by them), rates not negative."""
    p = s.prediction
    for name in ("period_us", "solver_period_us", "iteration_us", "sequential_period_us",
                 "sequential_iteration_us"):
        if not getattr(p, name) > 0:
            raise _fail(where, f"prediction.{name}", f"must be positive, got {getattr(p, name)}")
    for name in ("tokens_per_s", "optimal_tokens_per_s"):
        if getattr(p, name) < 0:
            raise _fail(where, f"prediction.{name}", f"must be >= 0, got {getattr(p, name)}")


def _check_ranges(s: Schedule, where: str) -> None:
    for op, ranges in s.ranges.items():
        if op not in optable.ALL_NAMES:  # the op table's, read at check time
            raise _fail(where, "ranges", f"op {op!r} is not one of {optable.ALL_NAMES}")
        if not ranges or len(ranges) > MAX_NANO_OPS_PER_OP:
            raise _fail(where, f"ranges[{op}]", f"must hold 1..{MAX_NANO_OPS_PER_OP} ranges, "
                        f"got {len(ranges)}")
        lo, hi = op_domain(op, s.batch.dense_batch, s.batch.num_decode)
        pos = lo
        for r in ranges:
            if len(r) != 2 or r[0] != pos or r[1] <= r[0]:
                raise _fail(where, f"ranges[{op}]", f"{[list(x) for x in ranges]} must be "
                            f"consecutive non-empty ranges covering [{lo}, {hi}) without overlap")
            pos = r[1]
        if pos != hi:
            raise _fail(where, f"ranges[{op}]", f"end at {pos}, the op's tokens end at {hi}")


def _check_nano_ops(s: Schedule, where: str) -> None:
    streams = {st.name: st for st in s.streams}
    if len(streams) != len(s.streams):
        raise _fail(where, "streams", "stream names must be unique")
    seen: dict[str, NanoOp] = {}
    covered: set[tuple[str, int, int]] = set()
    for n in s.nano_ops:
        here = f"nano_ops[{n.id}]"
        if n.id in seen:
            raise _fail(where, here, "duplicate id")
        seen[n.id] = n
        if (n.start, n.end) not in s.ranges.get(n.op, ()):
            raise _fail(where, here, f"range [{n.start}, {n.end}) is not one of ranges[{n.op}]")
        if (n.op, n.start, n.end) in covered:
            raise _fail(where, here, f"a second nano-op on range [{n.start}, {n.end})")
        covered.add((n.op, n.start, n.end))
        st = streams.get(n.stream)
        if st is None:
            raise _fail(where, here, f"stream {n.stream!r} is not one of {sorted(streams)}")
        if n.resource not in RESOURCES or n.resource not in ("other", st.resource):
            raise _fail(where, here, f"a {n.resource} op cannot run on the {st.resource} stream")
        _check_alloc(s, n, f"{here}.alloc", where)
        _check_horizon(s, n, here, where)
    for op, ranges in s.ranges.items():
        for r in ranges:
            if (op, r[0], r[1]) not in covered:
                raise _fail(where, f"ranges[{op}]", f"range {list(r)} has no nano-op")


def _check_alloc(s: Schedule, n: NanoOp, here: str, where: str) -> None:
    a = n.alloc
    if not (0 < a.share <= 1 and 0 < a.p <= 1.5 and 1 <= a.units <= MAX_SMS):
        raise _fail(where, here, f"share {a.share} must be in (0, 1], p {a.p} in (0, 1.5], "
                    f"units {a.units} in 1..{MAX_SMS}")
    if a.mechanism not in MECHANISMS:
        raise _fail(where, f"{here}.mechanism", f"{a.mechanism!r} is not one of {MECHANISMS}")
    if a.mechanism == "green_ctx" and a.units > s.num_sms:
        raise _fail(where, f"{here}.units", f"{a.units} SMs, the GPU has {s.num_sms}")
    if a.side not in SIDE_VALUES:
        raise _fail(where, f"{here}.side", f"{a.side!r} is not one of {SIDE_VALUES}")


def _check_horizon(s: Schedule, n: NanoOp, here: str, where: str) -> None:
    """start_us within its layer offset's period, duration_us at most a period."""
    if n.layer_offset not in (0, 1):
        raise _fail(where, f"{here}.layer_offset", f"must be 0 or 1, got {n.layer_offset}")
    period = s.prediction.solver_period_us
    slack = EPS_US * max(1.0, period)
    if not n.duration_us > 0 or n.duration_us > period + slack:
        raise _fail(where, f"{here}.duration_us", f"{n.duration_us} must be in (0, "
                    f"solver_period_us = {period:g}]")
    lo = n.layer_offset * period
    if not lo - slack <= n.start_us < lo + period + slack:
        raise _fail(where, f"{here}.start_us", f"{n.start_us} must be in [{lo:g}, "
                    f"{lo + period:g}): layer_offset {n.layer_offset} x solver_period_us "
                    f"{period:g} and the period after it")


def _check_orders(s: Schedule, where: str) -> None:
    for st in s.streams:
        orders = sorted(n.order for n in s.nano_ops if n.stream == st.name)
        if orders != list(range(len(orders))):
            raise _fail(where, f"streams[{st.name}]", f"issue orders {orders} are not a "
                        f"permutation of 0..{len(orders) - 1}")


def _check_deps(s: Schedule, where: str) -> None:
    """Deps exist; none waits on a later period; same-period deps + stream orders acyclic."""
    ids = {n.id: n for n in s.nano_ops}
    succ: dict[str, list[str]] = {i: [] for i in ids}
    for n in s.nano_ops:
        for d in n.deps:
            if d.id not in ids:
                raise _fail(where, f"nano_ops[{n.id}].deps", f"{d.id!r} does not exist")
            shifts = (-1, 0, 1) if d.kind == "resource" else (0, 1)
            if d.shift not in shifts or d.kind not in DEP_KINDS:
                raise _fail(where, f"nano_ops[{n.id}].deps[{d.id}]", f"kind must be one of "
                            f"{DEP_KINDS} and shift one of {shifts}, got {d.kind!r}/{d.shift}")
            lag = d.shift + n.layer_offset - ids[d.id].layer_offset
            if lag < 0:
                raise _fail(where, f"nano_ops[{n.id}].deps[{d.id}]", "waits on a nano-op "
                            "issued in a later period (layer offsets)")
            if lag == 0:
                succ[d.id].append(n.id)
    for st in s.streams:
        chain = sorted((n for n in s.nano_ops if n.stream == st.name), key=lambda n: n.order)
        for a, b in zip(chain, chain[1:], strict=False):
            succ[a.id].append(b.id)
    cycle = find_cycle(succ)
    if cycle:
        raise _fail(where, "nano_ops.deps", "dependencies and stream orders form a cycle "
                    f"within a period: {' -> '.join(cycle)}")


def find_cycle(succ: dict[str, list[str]]) -> list[str]:
    """A cycle of the directed graph, or [] when it is acyclic."""
    state: dict[str, int] = {}
    for root in sorted(succ):
        if state.get(root):
            continue
        stack, path = [(root, iter(succ[root]))], [root]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(succ[nxt])))
                path.append(nxt)
    return []


def unrolled(s: Schedule) -> list[tuple[float, float, NanoOp, int]]:
    """(start, end, nano-op, layer) of enough layer copies to see every steady-state overlap."""
    period = s.prediction.solver_period_us
    last = max((n.end_us for n in s.nano_ops), default=0.0)
    copies = math.ceil(last / period) + 2
    return [(n.start_us + k * period, n.end_us + k * period, n, k)
            for k in range(copies) for n in s.nano_ops]


def check_capacity(s: Schedule, where: str = "schedule") -> None:
    """Shares of concurrently-running nano-ops <= 1, green-context SMs <= the GPU's."""
    spans = unrolled(s)
    for t in sorted({a for a, _, _, _ in spans}):
        running = [(n, k) for a, b, n, k in spans if a <= t + EPS_US and b > t + EPS_US]
        share = sum(n.alloc.share for n, _ in running)
        sms = sum(n.alloc.units for n, _ in running if n.alloc.mechanism == "green_ctx")
        if share > 1 + 1e-6 or sms > s.num_sms:
            names = ", ".join(f"{n.id}@L{k} ({n.alloc.share:g})" for n, k in running)
            raise _fail(where, "nano_ops.alloc", f"GPU capacity exceeded at {t:.1f} us: "
                        f"shares sum to {share:.3f} > 1 or green-context SMs {sms} > "
                        f"{s.num_sms} ({names})")
