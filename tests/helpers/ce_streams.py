"""A transport for the copy-engine all-reduce that models CUDA streams in one CPU process.

Every step the all-reduce issues (flag writes and waits, copies, event forks, the reduction on
the caller's stream) is queued on its stream; `World.run` then executes the queued steps of
all ranks in a random order that keeps each stream in order, an event wait after its record,
and a flag wait until the flag is 1. So a missing fork, a flag written too early or a buffer
reused too soon shows as a wrong sum under some order, as it would on GPUs whose streams race;
`unjoined` names side streams left with work the caller's stream does not wait for, which a
CUDA graph capture refuses.
"""

from __future__ import annotations

import ctypes
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanosched.kernels.ce_allreduce import reduce_reference
from nanosched.kernels.ce_transports import Region

Step = tuple[Callable[[], bool], Callable[[], None]]  # (can it run now, run it)


@dataclass
class Stream:
    name: str
    steps: deque[Step] = field(default_factory=deque)
    joined: bool = True  # nothing queued since its last event was waited on by S

    def add(self, step: Step) -> None:
        self.steps.append(step)
        self.joined = False


def _always() -> bool:
    return True


class World:
    """The ranks' streams and buffers; `run` drains them in a random legal order."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.rng = size, random.Random(seed)
        self.streams: list[Stream] = []
        self.shares: dict[int, list[int]] = {}

    def run(self, max_steps: int = 10**6) -> None:
        for _ in range(max_steps):
            live = [s for s in self.streams if s.steps]
            if not live:
                return
            ready = [s for s in live if s.steps[0][0]()]
            if not ready:
                raise AssertionError("deadlock: every stream waits (" + ", ".join(
                    s.name for s in live) + ")")
            self.rng.choice(ready).steps.popleft()[1]()
        raise AssertionError("the streams did not drain")


class SimTransport:
    """One rank's transport in a `World`: its caller's stream S and a pull and a push stream
    per peer. `on_s(fn)` queues other work (the model writing the next layer) on S."""

    def __init__(self, rank: int, world: World) -> None:
        self.rank, self.world, n = rank, world, world.size - 1
        self.s = Stream(f"r{rank}.S")
        self.pulls = [Stream(f"r{rank}.P{i}") for i in range(n)]
        self.pushes = [Stream(f"r{rank}.D{i}") for i in range(n)]
        world.streams += [self.s, *self.pulls, *self.pushes]
        self._shared = 0

    def share(self, t: torch.Tensor, group: object) -> Region:
        ptrs = self.world.shares.setdefault(self._shared, [0] * self.world.size)
        self._shared += 1
        ptrs[self.rank] = t.data_ptr()  # the other ranks fill theirs before anything runs
        return Region(t.data_ptr(), t.numel() * t.element_size(), ptrs)

    def streams(self, peers: list[int]) -> tuple[Stream, list[Stream], list[Stream]]:
        return self.s, self.pulls[: len(peers)], self.pushes[: len(peers)]

    def fork(self, src: Stream, dst: Stream) -> None:
        recorded = [False]
        src.add((_always, lambda: recorded.__setitem__(0, True)))
        dst.add((lambda: recorded[0], lambda: None))
        src.joined = dst is self.s

    def write_flag(self, stream: Stream, addr: int) -> None:
        stream.add((_always, lambda: setattr(ctypes.c_int32.from_address(addr), "value", 1)))

    def wait_flag(self, stream: Stream, addr: int) -> None:
        flag = ctypes.c_int32.from_address(addr)
        stream.add((lambda: flag.value == 1, lambda: setattr(flag, "value", 0)))

    def copy(self, stream: Stream, dst: int, src: int, nbytes: int) -> None:
        stream.add((_always, lambda: ctypes.memmove(dst, src, nbytes)))

    def reduce(self, x: torch.Tensor, rows: torch.Tensor, max_ctas: int | None = None) -> None:
        self.s.add((_always, lambda: reduce_reference(x, rows)))

    def on_s(self, fn: Callable[[], None]) -> None:
        self.s.add((_always, fn))

    def unjoined(self) -> list[str]:
        """Side streams with work S does not wait for (a CUDA graph capture would fail)."""
        return [x.name for x in (*self.pulls, *self.pushes) if not x.joined]
