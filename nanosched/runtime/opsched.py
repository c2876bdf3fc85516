"""The programmable operator-scheduling API (DynaFlow §3.2.2) over a `Program`.

A strategy subclasses `OpScheduler` and implements `schedule(ctx)` with three calls:

- `ctx.split(sizes)`: cut the T tokens into micro-batches of these sizes (in order);
- `ctx.get_ready_ops(i)`: the nano-ops of micro-batch i whose dependencies are dispatched;
- `ctx.execute(ops, stream=None, replace_func=None)`: dispatch ready nano-ops. Several
  micro-batches of one op with adjacent ranges merge into one launch over the union; with a
  `replace_func`, the given nano-ops (of any ops) run as that one fused callable; different ops
  without one run one after another.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nanosched.errors import ScheduleError
from nanosched.runtime.backend import Backend
from nanosched.runtime.program import DEFAULT_LAUNCH, LaunchConfig, Program, overlaps

MAIN_STREAM = "main"


@dataclass(frozen=True)
class OpInstance:
    """Op `index` of the program on micro-batch `mb`, covering tokens [start, end): one nano-op
    as the scheduler API hands it to a strategy (the schedule file's record is
    `schedules.format.NanoOp`)."""

    index: int
    mb: int
    start: int
    end: int


def _cross_candidates(program: Program) -> list[list[int]]:
    """Per op k, the earlier ops that may conflict with it across micro-batches.

    Depends only on each op's (buffer, is_write, has_span) accesses, which every forward of a
    model repeats, so it is computed once per access structure."""
    return _candidates_of(tuple(
        tuple((a.buffer, False, a.span is not None) for a in op.reads) +
        tuple((a.buffer, True, a.span is not None) for a in op.writes) for op in program.ops))


@functools.lru_cache(maxsize=16)
def _candidates_of(structure: tuple[tuple[tuple[str, bool, bool], ...], ...]
                   ) -> list[list[int]]:
    touched: dict[str, list[tuple[int, bool, bool]]] = {}  # buffer -> (op, is_write, has_span)
    result: list[list[int]] = []
    for k, mine in enumerate(structure):
        cands: set[int] = set()
        for buf, is_write, has_span in mine:
            for k2, w2, s2 in touched.get(buf, ()):
                if (is_write or w2) and (has_span or s2):
                    cands.add(k2)
        result.append(sorted(cands))
        for buf, is_write, has_span in mine:
            touched.setdefault(buf, []).append((k, is_write, has_span))
    return result


class SchedContext:
    """Tracks dispatch progress per micro-batch and turns `execute` into backend launches."""

    def __init__(self, program: Program, backend: Backend,
                 stream_configs: dict[str, LaunchConfig] | None = None) -> None:
        self.program = program
        self.backend = backend
        self.stream_configs = stream_configs or {}
        self._cands = _cross_candidates(program)
        self.ranges: list[tuple[int, int]] = []
        self._cursor: list[int] = []
        self._events: dict[tuple[int, int], tuple[str, Any]] = {}
        # (op, micro-batch) pairs found free of cross-micro-batch blockers: cursors only
        # advance, so a pair once unblocked stays so
        self._unblocked: set[tuple[int, int]] = set()

    # ---- the API ---------------------------------------------------------------------------
    def split(self, sizes: Sequence[int]) -> None:
        if not sizes or any(s <= 0 for s in sizes) or sum(sizes) != self.program.num_tokens:
            raise ScheduleError(f"split sizes {list(sizes)} must be positive and sum to the "
                                f"batch's {self.program.num_tokens} tokens")
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        self.ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
        self._cursor = [0] * len(sizes)
        self._unblocked.clear()

    @property
    def num_micro_batches(self) -> int:
        return len(self.ranges)

    def get_ready_ops(self, i: int) -> list[OpInstance]:
        k = self._cursor[i]
        if k >= len(self.program.ops):
            return []
        nano = OpInstance(k, i, *self.ranges[i])
        return [nano] if self._blocker(nano) is None else []

    def is_ready(self, index: int, i: int) -> bool:
        """Whether op `index` of micro-batch `i` is ready (cheaper than get_ready_ops)."""
        if self._cursor[i] != index:
            return False
        return self._blocker(OpInstance(index, i, *self.ranges[i])) is None

    def execute(self, ops: OpInstance | Sequence[OpInstance], stream: str | None = None,
                replace_func: Callable[[Sequence[OpInstance]], None] | None = None,
                launch: LaunchConfig | None = None, after: Sequence[OpInstance] = ()) -> None:
        """Dispatch ready nano-ops on `stream`. Beyond DynaFlow's API: `launch` overrides the
        stream's launch config, and `after` orders this launch behind earlier dispatched
        nano-ops with no data dependency (a schedule keeping two kernels apart)."""
        ops = (ops,) if isinstance(ops, OpInstance) else tuple(ops)
        if not ops:
            raise ScheduleError("execute() needs at least one nano-op")
        for nano in ops:
            self._check_ready(nano, ops)
        name = stream or MAIN_STREAM
        cfg = launch or self.stream_configs.get(name, DEFAULT_LAUNCH)
        waits = [self._events[(n.index, n.mb)] for n in after if (n.index, n.mb) in self._events]
        if replace_func is not None:
            self._launch(ops, name, lambda: replace_func(ops), waits)
        elif len({n.index for n in ops}) == 1:
            for group in _adjacent_groups(ops):
                op = self.program.ops[group[0].index]
                lo, hi = group[0].start, group[-1].end
                self._launch(group, name, lambda op=op, lo=lo, hi=hi: op.run(lo, hi, cfg), waits)
        else:
            for nano in ops:
                op = self.program.ops[nano.index]
                self._launch((nano,), name, lambda op=op, n=nano: op.run(n.start, n.end, cfg),
                             waits)
        for nano in ops:
            self._cursor[nano.mb] += 1

    def done(self, i: int | None = None) -> bool:
        idx = range(len(self._cursor)) if i is None else [i]
        return all(self._cursor[j] >= len(self.program.ops) for j in idx)

    # ---- internals -------------------------------------------------------------------------
    def _launch(self, group: Sequence[OpInstance], stream: str, fn: Callable[[], None],
                after: list[tuple[str, Any]]) -> None:
        reads, writes = [], []
        for n in group:
            op = self.program.ops[n.index]
            reads += [(a, a.rows(n.start, n.end)) for a in op.reads]
            writes += [(a, a.rows(n.start, n.end)) for a in op.writes]
        label = ""
        if self.backend.wants_labels:  # e.g. "L3.kqv[0:1024]+L3.kqv[1024:2048]"
            label = "+".join(f"{self.program.ops[n.index].name}[{n.start}:{n.end}]"
                             for n in group)
        event = self.backend.launch(stream, fn, reads, writes, after, label)
        for n in group:
            self._events[(n.index, n.mb)] = (stream, event)

    def _check_ready(self, nano: OpInstance, batch: Sequence[OpInstance]) -> None:
        if nano.index != self._cursor[nano.mb] or (nano.start, nano.end) != \
                self.ranges[nano.mb]:
            raise ScheduleError(f"{self.program.ops[nano.index].name} of micro-batch "
                                f"{nano.mb} is not its next op (next: op {self._cursor[nano.mb]})")
        blocker = self._blocker(nano, also_done={(n.index, n.mb) for n in batch
                                                 if n.index < nano.index})
        if blocker is not None:
            raise ScheduleError(f"{self.program.ops[nano.index].name} of micro-batch {nano.mb} "
                                f"is not ready: it needs {self.program.ops[blocker[0]].name} "
                                f"of micro-batch {blocker[1]} first")

    def _blocker(self, nano: OpInstance, also_done: set[tuple[int, int]] = frozenset()
                 ) -> tuple[int, int] | None:
        if (nano.index, nano.mb) in self._unblocked:
            return None
        op = self.program.ops[nano.index]
        for k2 in self._cands[nano.index]:
            other = self.program.ops[k2]
            for j, (lo, hi) in enumerate(self.ranges):
                if j == nano.mb or self._cursor[j] > k2 or (k2, j) in also_done:
                    continue
                if _conflict(op, nano.start, nano.end, other, lo, hi):
                    return k2, j
        if not also_done:
            self._unblocked.add((nano.index, nano.mb))
        return None


def _conflict(a, a_lo: int, a_hi: int, b, b_lo: int, b_hi: int) -> bool:
    for acc_a in a.reads + a.writes:
        is_write_a = acc_a in a.writes
        for acc_b in b.reads + b.writes:
            if acc_a.buffer != acc_b.buffer or not (is_write_a or acc_b in b.writes):
                continue
            if overlaps(acc_a.rows(a_lo, a_hi), acc_b.rows(b_lo, b_hi)):
                return True
    return False


def _adjacent_groups(ops: Sequence[OpInstance]) -> list[list[OpInstance]]:
    groups: list[list[OpInstance]] = []
    for n in sorted(ops, key=lambda n: n.start):
        if groups and groups[-1][-1].end == n.start:
            groups[-1].append(n)
        else:
            groups.append([n])
    return groups


class OpScheduler(ABC):
    """A scheduling strategy: subclasses implement `schedule(ctx)` with the API above."""

    name = "strategy"
    pipelined = False  # whether it overlaps ops of a batch (counted apart in the engine's stats)

    @classmethod
    def for_gpu(cls, num_sms: int) -> OpScheduler:
        """This strategy as `--schedule NAME` builds it (strategies.NAMED) for a GPU of
        `num_sms` SMs; a strategy whose settings depend on the GPU overrides it."""
        return cls()

    def accepts(self, program: Program) -> bool:
        """Whether this strategy runs `program`; the engine falls back when it does not."""
        return True

    def pick(self, program: Program, num_decode: int) -> OpScheduler | None:
        """The strategy that runs `program` (its first `num_decode` rows are decode rows):
        this one when it accepts it, else None (the engine's fallback runs it). A strategy
        made of others (a schedule set) returns the one for this batch's shape."""
        return self if self.accepts(program) else None

    @abstractmethod
    def schedule(self, ctx: SchedContext) -> None:
        """Dispatch every op of every micro-batch through `ctx`."""


def pick_strategy(strategy: OpScheduler, fallback: OpScheduler, program: Program,
                  num_decode: int) -> tuple[OpScheduler, bool]:
    """The one place a forward's strategy is chosen (the engine's eager batches and every
    CUDA-graph bucket alike): what `strategy` picks for `program` (its first `num_decode` rows
    decode rows), else `fallback`; and whether it fell back."""
    picked = strategy.pick(program, num_decode)
    return (fallback, True) if picked is None else (picked, False)


def run_program(program: Program, strategy: OpScheduler, backend: Backend,
                stream_configs: dict[str, LaunchConfig] | None = None) -> SchedContext:
    """Run one forward: the strategy dispatches everything, then streams join (also when the
    strategy fails, so the caller's stream is current again)."""
    ctx = SchedContext(program, backend, stream_configs)
    try:
        strategy.schedule(ctx)
        if not ctx.ranges or not ctx.done():
            raise ScheduleError(f"strategy {strategy.name!r} returned before dispatching every "
                                f"op")
    finally:
        backend.device.join()
        backend.reset()
    return ctx
