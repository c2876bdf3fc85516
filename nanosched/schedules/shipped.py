"""The schedules shipped in `nanosched/schedules/shipped/`, and picking one for a setup.

`pick_shipped(spec, tp, gpu_name)` returns the first shipped schedule (by file name) that
`check_compatible` accepts for that model, tp and GPU and that predicts a real gain over
Sequential (at least MIN_SPEEDUP), or None with the reason none does, so that `--schedule auto`
can say which schedule it replays or why it runs Sequential.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanosched.errors import ScheduleError
from nanosched.schedules.format import Schedule, check_compatible, load_schedule

SHIPPED_DIR = Path(__file__).with_name("shipped")
# below this predicted gain a replay is not worth its risk: on an H200 the shipped Llama-3-8B
# schedule predicted 1.01x and measured slower than Sequential on the GPU (README)
MIN_SPEEDUP = 1.05


@dataclass(frozen=True)
class Pick:
    """The outcome of `pick_shipped`: a schedule and its file, or the reason for none."""

    path: Path | None
    schedule: Schedule | None
    reason: str


def shipped_schedules(folder: Path = SHIPPED_DIR) -> list[Path]:
    """Every shipped schedule file, sorted by name."""
    return sorted(folder.glob("*.json"))


def pick_shipped(spec: Any, tp: int, gpu_name: str, folder: Path = SHIPPED_DIR,
                 kv_dtype: str = "auto") -> Pick:
    """The first shipped schedule made for `spec`, `tp`, `gpu_name` and `kv_dtype`, or why none
    is."""
    paths = shipped_schedules(folder)
    if not paths:
        return Pick(None, None, f"no schedules are shipped in {folder}")
    weak = []
    for path in paths:
        sched = load_schedule(path)
        try:
            check_compatible(sched, spec, tp, gpu_name, kv_dtype=kv_dtype)
        except ScheduleError:
            continue
        if sched.prediction.speedup < MIN_SPEEDUP:
            weak.append(f"{path.name} predicts only {sched.prediction.speedup:.2f}x")
            continue
        return Pick(path, sched, f"{path.name} matches {spec.name} tp={tp} on {gpu_name}")
    if weak:
        return Pick(None, None, f"{'; '.join(weak)} over Sequential (auto needs "
                                f"{MIN_SPEEDUP:.2f}x): running Sequential")
    names = ", ".join(p.name for p in paths)
    kv = "" if kv_dtype == "auto" else f" with a {kv_dtype} KV cache"
    return Pick(None, None, f"no shipped schedule is for {spec.name} tp={tp} on {gpu_name}{kv} "
                            f"(shipped: {names})")
