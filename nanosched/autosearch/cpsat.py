"""Shared CP-SAT plumbing: solving with limits, a progress callback, the stage report.

OR-Tools is imported inside the functions, so importing this module never needs it.

Ctrl-C. CP-SAT catches SIGINT itself by default and only ends the current solve, so a search
made of many solves would go on and write a file. `solve` turns that off: on the main thread it
routes signals to a pipe (`signal.set_wakeup_fd`), a watcher thread stops the solver at once on
SIGINT or SIGTERM, and the Python handler (the default one for SIGINT; `nanosched search` makes
SIGTERM raise too) raises KeyboardInterrupt in the caller when the solve returns, so the whole
search stops.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from nanosched.autosearch.durations import TICKS_PER_US
from nanosched.schedules.format import StageReport

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Limits:
    """Wall-clock limit and worker count of one solve."""

    time_limit_s: float
    num_workers: int
    deterministic: bool = False  # stop on CP-SAT's deterministic time: reproducible runs


def gap(objective: float, bound: float) -> float:
    return 0.0 if objective <= 0 else max(0.0, (objective - bound) / objective)


def _callback_class() -> type:
    from ortools.sat.python import cp_model

    class ProgressCallback(cp_model.CpSolverSolutionCallback):
        """Prints each improving solution: incumbent, bound, gap and elapsed time."""

        def __init__(self, stage: str, progress: Progress | None) -> None:
            super().__init__()
            self.stage, self.progress, self.count = stage, progress, 0
            self.last_shown, self.last_time = float("inf"), -1.0
            self.best, self.last_improved = float("inf"), None  # perf_counter() of the best

        def on_solution_callback(self) -> None:
            self.count += 1
            obj, bound = self.objective_value, self.best_objective_bound
            if obj < self.best:
                self.best, self.last_improved = obj, time.perf_counter()
            if self.progress is None or (obj > 0.99 * self.last_shown
                                         and self.wall_time < self.last_time + 2):
                return
            self.last_shown, self.last_time = obj, self.wall_time
            self.progress(f"  {self.stage}: solution {self.count}: period "
                          f"{obj / TICKS_PER_US:.1f} us, bound {bound / TICKS_PER_US:.1f} us, "
                          f"gap {100 * gap(obj, bound):.1f}%, {self.wall_time:.1f} s")

    return ProgressCallback


STOP_SIGNALS = {int(signal.SIGINT), int(signal.SIGTERM)}


@contextlib.contextmanager
def _stop_on_sigint(solver: Any) -> Iterator[None]:
    """While inside, SIGINT (or SIGTERM, when the caller made it raise KeyboardInterrupt) stops
    `solver`; KeyboardInterrupt then follows in the main thread. A no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    solver.parameters.catch_sigint_signal = False
    r, w = os.pipe()
    os.set_blocking(w, False)
    old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if select.select([r], [], [], 0.1)[0] and STOP_SIGNALS & set(os.read(r, 64)):
                solver.stop_search()
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(old)
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the watcher anyway
            os.write(w, b"\0")  # not a signal number: the watcher wakes, sees done, returns
        thread.join()  # at once, not after the rest of its 0.1 s select
        os.close(r)
        os.close(w)


def solve(model: Any, stage: str, limits: Limits, progress: Progress | None,
          stall_s: float | None = None, subsolvers: tuple[str, ...] = ()
          ) -> tuple[Any, StageReport, bool]:
    """Solve `model`; returns (solver, report, whether a solution was found).

    `stall_s`: stop once a solution is known and none better came for that many seconds
    (wall clock; ignored in deterministic mode). `subsolvers`: CP-SAT's worker portfolio
    (with two or more workers)."""
    import threading

    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = limits.num_workers
    if subsolvers and limits.num_workers >= 2:
        solver.parameters.subsolvers.extend(subsolvers)
    if limits.deterministic:
        solver.parameters.max_deterministic_time = max(0.01, limits.time_limit_s)
        solver.parameters.interleave_search = limits.num_workers > 1
    else:
        solver.parameters.max_time_in_seconds = max(0.01, limits.time_limit_s)
    callback = _callback_class()(stage, progress)
    start = time.perf_counter()
    done = threading.Event()
    if stall_s is not None and not limits.deterministic:
        def watch() -> None:
            while not done.wait(0.1):
                last = callback.last_improved
                if last is not None and time.perf_counter() - last > stall_s:
                    solver.stop_search()
                    return

        threading.Thread(target=watch, daemon=True).start()
    try:
        with _stop_on_sigint(solver):
            status = solver.solve(model, callback)
    finally:
        done.set()
    wall = time.perf_counter() - start
    name = solver.status_name(status)
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    obj = solver.objective_value / TICKS_PER_US if found else float("nan")
    bound = solver.best_objective_bound / TICKS_PER_US if found else float("nan")
    report = StageReport(stage, name, obj, bound, gap(obj, bound) if found else float("nan"),
                         round(wall, 3), limits.time_limit_s, limits.num_workers)
    return solver, report, found
