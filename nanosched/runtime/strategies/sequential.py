"""`Sequential`: the whole batch, one op after another, one stream. The baseline and fallback."""

from __future__ import annotations

from nanosched.constants import SEQUENTIAL
from nanosched.runtime.opsched import OpScheduler, SchedContext


class Sequential(OpScheduler):
    name = SEQUENTIAL

    def schedule(self, ctx: SchedContext) -> None:
        ctx.split([ctx.program.num_tokens])
        while not ctx.done():
            ctx.execute(ctx.get_ready_ops(0))
