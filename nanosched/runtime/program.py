"""What the runtime executes: a forward pass as an ordered list of ops over token ranges.

A `Program` is the ops of one forward over a dense batch of T tokens, in program order (layer 0's
ops, then layer 1's, ...). Each `ProgramOp` can run on any token range [start, end) and declares
which buffers it reads and writes over that range. Most ops touch exactly the rows of their range;
an op that touches other rows says so with a span (prefill attention reads the K/V rows of the
earlier tokens of its prompts). From these declarations alone the scheduler knows which nano-ops
are ready and the backend knows which cross-stream waits a launch needs, so model code never
mentions streams, events or schedules.

`run(start, end, cfg)` launches the op's kernels for the range on the current stream; `cfg`
carries what the schedule chose for that nano-op (SM or CTA bound, implementation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nanosched.kernels import impls

SpanFunc = Callable[[int, int], tuple[int, int]]


@dataclass(frozen=True)
class LaunchConfig:
    """How one stream's launches are resourced, and which implementations they use.

    `num_sms`: SMs of the stream's partition (GEMM SM target / programs); `max_ctas`: CTA bound
    of bounded kernels; `num_splits`: split-K of decode attention; `impl`: one implementation
    name, applied to the ops whose vocabulary has it, or a mapping op name -> name. Names are
    those of nanosched/kernels/impls.py and are checked here.
    """

    max_ctas: int | None = None
    num_sms: int | None = None
    impl: str | Mapping[str, str] | None = None
    num_splits: int | None = None
    partition: bool = False  # the stream is a green-context partition of `num_sms` SMs

    def __post_init__(self) -> None:
        if isinstance(self.impl, str):
            impls.check_any(self.impl)
        elif self.impl is not None:
            for op, name in self.impl.items():
                impls.check_op_impl(op, name)

    def impl_for(self, op: str) -> str | None:
        """The implementation op `op` launches under this config (None: the model's default)."""
        if self.impl is None:
            return None
        if isinstance(self.impl, str):
            return self.impl if impls.applies(op, self.impl) else None
        return self.impl.get(op)

    def launch_dict(self, op: str) -> dict[str, Any] | None:
        """The launch dict of op `op` (kernels/impls.py contract), None when it says nothing."""
        out = {"impl": self.impl_for(op), "num_sms": self.num_sms, "max_ctas": self.max_ctas,
               "num_splits": self.num_splits, "partition": self.partition or None}
        return {k: v for k, v in out.items() if v is not None} or None


DEFAULT_LAUNCH = LaunchConfig()


@dataclass(frozen=True)
class Access:
    """A buffer touched by an op; `span` maps the op's range to the rows touched (default: same)."""

    buffer: str
    span: SpanFunc | None = None

    def rows(self, start: int, end: int) -> tuple[int, int]:
        return (start, end) if self.span is None else self.span(start, end)


@dataclass(frozen=True)
class ProgramOp:
    op: str  # the op's name in the layer ("kqv", "attn_decode", ...)
    layer: int  # -1 for ops outside the layers (embedding, LM head)
    resource: str
    run: Callable[[int, int, LaunchConfig], None]
    reads: tuple[Access, ...] = ()
    writes: tuple[Access, ...] = ()

    @property
    def name(self) -> str:
        return self.op if self.layer < 0 else f"L{self.layer}.{self.op}"


@dataclass(frozen=True)
class Program:
    num_tokens: int
    ops: tuple[ProgramOp, ...] = field(default_factory=tuple)

    def index(self, op: str, layer: int) -> int:
        for k, p in enumerate(self.ops):
            if p.op == op and p.layer == layer:
                return k
        raise KeyError(f"program has no op {op!r} in layer {layer}")


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]
