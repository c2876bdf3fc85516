"""The schedules shipped in `nanosched/schedules/shipped/`, and picking one for a setup.

`pick_shipped(spec, tp, gpu_name)` returns the first shipped schedule (by file name) that
`check_compatible` accepts for that model, tp and GPU, or None with the reason none fits, so
that `--schedule auto` can say which schedule it replays or why it runs Sequential.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanosched.errors import ScheduleError
from nanosched.schedules.format import Schedule, check_compatible, load_schedule

SHIPPED_DIR = Path(__file__).with_name("shipped")


@dataclass(frozen=True)
class Pick:
    """The outcome of `pick_shipped`: a schedule and its file, or the reason for none."""

    path: Path | None
    schedule: Schedule | None
    reason: str


def shipped_schedules(folder: Path = SHIPPED_DIR) -> list[Path]:
    """Every shipped schedule file, sorted by name."""
    return sorted(folder.glob("*.json"))


def pick_shipped(spec: Any, tp: int, gpu_name: str, folder: Path = SHIPPED_DIR) -> Pick:
    """The first shipped schedule made for `spec`, `tp` and `gpu_name`, or why none is."""
    paths = shipped_schedules(folder)
    if not paths:
        return Pick(None, None, f"no schedules are shipped in {folder}")
    for path in paths:
        sched = load_schedule(path)
        try:
            check_compatible(sched, spec, tp, gpu_name)
        except ScheduleError:
            continue
        return Pick(path, sched, f"{path.name} matches {spec.name} tp={tp} on {gpu_name}")
    names = ", ".join(p.name for p in paths)
    return Pick(None, None, f"no shipped schedule is for {spec.name} tp={tp} on {gpu_name} "
                            f"(shipped: {names})")
