"""Two-batch overlap with TokenWeave's wave-aware token split (TokenWeave §3.1).

The batch is cut into two token sets so that the waves of the largest GEMM over both halves do
not exceed its waves over the whole: the first part is a whole number of waves
(tiles of `tile_m` tokens x `num_sms` SMs per wave), the rest goes to the second. The two
micro-batches then advance op by op, interleaved, with network and memory ops on their own
streams, so one half's communication or attention runs beside the other half's GEMMs.
"""

from __future__ import annotations

import math

from nanosched.constants import DEFAULT_NUM_SMS
from nanosched.errors import ScheduleError
from nanosched.models.ops import MEMORY, NETWORK
from nanosched.runtime.opsched import MAIN_STREAM, OpScheduler, SchedContext


def wave_aware_split(num_tokens: int, n_tiles: int, num_sms: int, tile_m: int = 128
                     ) -> tuple[int, int]:
    """Sizes (first, second) of a split that adds no GEMM wave.

    A GEMM over t tokens with `n_tiles` output-column tiles launches ceil(t / tile_m) * n_tiles
    CTAs, i.e. ceil(CTAs / num_sms) waves. The first part takes the largest number of whole
    waves that stays at or below half the tokens (at least one row of tiles); if no split adds
    no wave, the halves are as equal as the tile size allows.
    """
    rows = math.ceil(num_tokens / tile_m)
    if rows < 2:
        raise ScheduleError(f"cannot split {num_tokens} tokens into two parts of "
                            f"{tile_m}-token tiles")

    def waves(r: int) -> int:
        return math.ceil(r * n_tiles / num_sms)

    whole = waves(rows)
    for first_rows in range(rows // 2, 0, -1):
        if waves(first_rows) + waves(rows - first_rows) <= whole:
            return first_rows * tile_m, num_tokens - first_rows * tile_m
    half = rows // 2 * tile_m
    return half, num_tokens - half


class TwoBatchOverlap(OpScheduler):
    """Interleave two micro-batches; memory and network ops go to a stream of their class.

    A batch too small to split (under two tiles) runs as one micro-batch, like `Sequential`.
    """

    name = "two_batch"
    pipelined = True

    def __init__(self, sizes: tuple[int, int] | None = None, n_tiles: int = 32,
                 num_sms: int = DEFAULT_NUM_SMS, tile_m: int = 128) -> None:
        self.sizes = sizes
        self.n_tiles = n_tiles
        self.num_sms = num_sms
        self.tile_m = tile_m

    @classmethod
    def for_gpu(cls, num_sms: int) -> TwoBatchOverlap:
        return cls(num_sms=num_sms)

    def schedule(self, ctx: SchedContext) -> None:
        t = ctx.program.num_tokens
        if self.sizes is None and t < 2 * self.tile_m:
            ctx.split([t])
        else:
            ctx.split(list(self.sizes or wave_aware_split(t, self.n_tiles, self.num_sms,
                                                          self.tile_m)))
        while not ctx.done():
            ready = [n for i in range(ctx.num_micro_batches) for n in ctx.get_ready_ops(i)]
            if not ready:
                raise ScheduleError("two-batch overlap is stuck: no micro-batch has a ready op")
            for nano in ready:
                resource = ctx.program.ops[nano.index].resource
                ctx.execute(nano, stream=resource if resource in (MEMORY, NETWORK)
                            else MAIN_STREAM)
