"""`ReplaySet(set)`: a schedule set (`nanosched.schedule/2`) as one strategy.

Per batch it picks the set's entry for the batch's shape (D decode rows of T: its key by
`schedules.sets.set_key`) and runs it: a pipeline entry through `Replay`, its boundaries moved
onto the batch's rows, a sequential entry through `Sequential` (the set's decision, counted as
such), no entry through the engine's fallback (`pick` returns None). The engine asks once per
CUDA-graph bucket, so each (entry, bucket) gets its own graph. Replays are built once per
(D, T) shape; a pipeline whose nano-batches do not fit a bucket's rows (`remap_rows` refuses)
runs that bucket sequentially, with a warning.
"""

from __future__ import annotations

import logging

from nanosched.errors import ScheduleError
from nanosched.runtime.opsched import OpScheduler, SchedContext
from nanosched.runtime.program import Program
from nanosched.runtime.strategies.replay import Replay, stream_key
from nanosched.runtime.strategies.sequential import Sequential
from nanosched.schedules.sets import PIPELINE, ScheduleSet

log = logging.getLogger("nanosched.replay_set")


class ReplaySet(OpScheduler):
    name = "replay_set"
    pipelined = True

    def __init__(self, sset: ScheduleSet, num_layers: int) -> None:
        self.set = sset
        self.num_layers = num_layers
        self.sequential = Sequential()
        self._replays: dict[tuple[int, int], OpScheduler] = {}
        # the streams every pipeline entry names (opened once, before any batch runs)
        self.streams = {stream_key(n) for e in sset.pipelines if e.schedule is not None
                        for n in e.schedule.nano_ops}

    def pick(self, program: Program, num_decode: int) -> OpScheduler | None:
        entry = self.set.entry(num_decode, program.num_tokens)
        if entry is None:
            return None
        if entry.kind != PIPELINE or entry.schedule is None:
            return self.sequential
        shape = (num_decode, program.num_tokens)
        if shape not in self._replays:
            try:
                self._replays[shape] = Replay(entry.schedule, self.num_layers, rows=shape)
            except ScheduleError as exc:  # its nano-batches do not fit this bucket's rows
                log.warning("schedule set: %s; running Sequential for %d decode of %d rows",
                            exc, *shape)
                self._replays[shape] = self.sequential
        return self._replays[shape]

    def schedule(self, ctx: SchedContext) -> None:
        # a set dispatches nothing itself: the engine, the bucket runner, `bench` and `verify`
        # run the strategy `pick` returns; a direct `run_program(program, set)` is a misuse
        raise TypeError("ReplaySet runs no batch itself: run the strategy its pick() returns")
