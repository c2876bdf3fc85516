"""The profiling loop's state between pieces: saving the partial file, the clock's drift, the
deadline of a time-limited run, and progress (runner.py drives it).

`Loop.save` writes `FILE.partial.json` atomically every `SAVE_EVERY` rows or `SAVE_EVERY_S`;
`Loop.check_drift` re-times the reference GEMM every `DRIFT_EVERY` rows and warns beyond
`DRIFT_LIMIT`; `Loop.need(seconds, what)` raises `TimeUp` when a piece and the finish would not
fit before `RunOptions.deadline`; `Loop.begin` / `Loop.report` count each phase's pieces and,
without a progress bar, print a line every `PROGRESS_EVERY_S` with the time the phase has left.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanosched.errors import NanoschedError
from nanosched.profiler.backend import ProfilerBackend
from nanosched.profiler.plan import ProfileSettings
from nanosched.profiler.state import RunState, partial_path, save_state

SAVE_EVERY = 100  # rows, or
SAVE_EVERY_S = 15.0  # seconds, whichever comes first
PROGRESS_EVERY_S = 60.0
FINISH_MARGIN_S = 10.0  # building and writing the profile after the last piece
DRIFT_EVERY = 200
DRIFT_LIMIT = 0.05


class ProfileInterrupted(NanoschedError):
    """Ctrl-C during a profile; the partial file is saved and the message says how to resume."""


class ProfileStopped(NanoschedError):
    """The time limit came first; the partial file is saved and the message says how to go on."""


class TimeUp(Exception):
    """The next piece would not fit before the deadline (what it was: the message)."""


@dataclass
class RunOptions:
    out: Path
    resume: bool = False
    progress: bool = True
    command: str = ""
    log: Callable[[str], None] = print
    resume_hint: str = "the same command with --resume"
    deadline: float | None = None  # on `clock`: stop before what would end after it
    clock: Callable[[], float] = time.monotonic


@dataclass
class Phase:
    """Pieces of one phase (kernel rows, pairs, forward, network pairs) for progress lines."""

    name: str
    total: int
    done: int
    done_at_start: int = 0
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.done_at_start = self.done


@dataclass
class Loop:
    settings: ProfileSettings
    backend: ProfilerBackend
    state: RunState
    opts: RunOptions
    bar: Any = None
    since_save: int = 0
    since_drift: int = 0
    started: float = field(default_factory=time.perf_counter)
    saved_at: float = field(default_factory=time.perf_counter)
    phase: Phase = field(default_factory=lambda: Phase("", 0, 0))
    reported_at: float = field(default_factory=time.perf_counter)
    run_started: float = field(default_factory=time.perf_counter)

    def say(self, text: str) -> None:
        """A line above the bar, or through the log without one."""
        shown = self.bar is not None and not self.bar.disable
        (self.bar.write if shown else self.opts.log)(text)

    def warn(self, text: str) -> None:
        self.say(f"warning: {text}")
        self.state.note(text)

    def time_left(self) -> float:
        deadline = self.opts.deadline
        return float("inf") if deadline is None else deadline - self.opts.clock()

    def need(self, seconds: float, what: str) -> None:
        """Stop (`TimeUp`) unless `seconds` and the finish fit before the deadline."""
        if self.time_left() < seconds + FINISH_MARGIN_S:
            raise TimeUp(what)

    def begin(self, name: str, total: int, done: int) -> None:
        if total > done:
            self.say(f"{name}: {total - done} of {total} to measure")
        self.phase = Phase(name, total, done)

    def report(self, count: int = 1) -> None:
        """Count `count` pieces done; without a bar, a progress line every PROGRESS_EVERY_S."""
        ph = self.phase
        ph.done += count
        now = time.perf_counter()
        if (self.bar is not None and not self.bar.disable) or (
                now - self.reported_at < PROGRESS_EVERY_S):
            return
        self.reported_at = now
        rate = (now - ph.started) / max(1, ph.done - ph.done_at_start)
        self.opts.log(f"progress: {ph.name} {ph.done}/{ph.total}; {now - self.run_started:.0f} s "
                      f"in this run, about {rate * (ph.total - ph.done):.0f} s left in this "
                      f"phase")

    def done_one(self) -> None:
        if self.bar is not None:
            self.bar.update(1)
        self.report()
        self.since_save += 1
        self.since_drift += 1
        if self.since_save >= SAVE_EVERY or time.perf_counter() - self.saved_at > SAVE_EVERY_S:
            self.save()
        if self.since_drift >= DRIFT_EVERY:
            self.check_drift()

    def save(self) -> None:
        now = time.perf_counter()
        self.state.elapsed_s += now - self.started
        self.started = now
        save_state(self.state, partial_path(self.opts.out))
        self.since_save, self.saved_at = 0, time.perf_counter()

    def check_drift(self) -> None:
        self.since_drift = 0
        ref = self.state.reference_us
        now = self.backend.reference_us()
        if ref and abs(now / ref - 1) > DRIFT_LIMIT:
            why = ("slower: throttling or another process" if now > ref else
                   "faster: the start was measured before the clocks settled")
            self.warn(f"reference GEMM takes {now:.1f} us, {100 * (now / ref - 1):+.0f}% from "
                      f"{ref:.1f} us at the start ({why}); rows measured around now are suspect")
