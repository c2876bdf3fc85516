"""The schedule sets shipped in `nanosched/schedules/shipped/`, and picking one for a setup.

`pick_shipped_schedule(spec, tp, gpu_name)` returns the first shipped file (by name) that
`check_compatible` accepts for that model, tp, GPU and KV cache dtype and that predicts a real
gain somewhere: a set (`nanosched.schedule/2`) with at least one pipeline entry (each entry was
kept only where it predicts its set's `min_gain`), or a single schedule (`/1`) predicting at
least MIN_SPEEDUP. Else None with the reason, so that `--schedule auto` can say which set it
replays or why it runs Sequential.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanosched.errors import ScheduleError
from nanosched.schedules.format import FORMAT as SINGLE_FORMAT
from nanosched.schedules.sets import ScheduleSet, check_set_compatible, load_schedule_set

SHIPPED_DIR = Path(__file__).with_name("shipped")
# below this predicted gain a replay is not worth its risk: on an H200 the shipped Llama-3-8B
# schedule predicted 1.01x and measured slower than Sequential on the GPU (README)
MIN_SPEEDUP = 1.05


@dataclass(frozen=True)
class Pick:
    """The outcome of `pick_shipped_schedule`: a schedule and its file, or the reason for none."""

    path: Path | None
    schedule: ScheduleSet | None
    reason: str


def shipped_schedules(folder: Path = SHIPPED_DIR) -> list[Path]:
    """Every shipped schedule file, sorted by name."""
    return sorted(folder.glob("*.json"))


def pick_shipped_schedule(spec: Any, tp: int, gpu_name: str, folder: Path = SHIPPED_DIR,
                 kv_dtype: str = "auto", quantization: str = "none") -> Pick:
    """The first shipped schedule made for `spec`, `tp`, `gpu_name`, `kv_dtype` and
    `quantization`, or why none is."""
    paths = shipped_schedules(folder)
    if not paths:
        return Pick(None, None, f"no schedules are shipped in {folder}")
    weak = []
    for path in paths:
        sset = load_schedule_set(path)
        try:
            check_set_compatible(sset, spec, tp, gpu_name, kv_dtype=kv_dtype,
                                 quantization=quantization)
        except ScheduleError:
            continue
        best = max((e.speedup for e in sset.pipelines), default=1.0)
        need = MIN_SPEEDUP if sset.source_format == SINGLE_FORMAT else sset.min_gain
        if not sset.pipelines or best < need:
            weak.append(f"{path.name} predicts only {best:.2f}x")
            continue
        n = len(sset.pipelines)
        return Pick(path, sset, f"{path.name} matches {spec.name} tp={tp} on {gpu_name} "
                                f"({n} of {len(sset.entries)} batch shapes pipelined, up to "
                                f"{best:.2f}x)")
    if weak:
        return Pick(None, None, f"{'; '.join(weak)} over Sequential (auto needs a "
                                f"pipelined batch shape): running Sequential")
    names = ", ".join(p.name for p in paths)
    kv = "" if kv_dtype == "auto" else f" with a {kv_dtype} KV cache"
    kv += "" if quantization == "none" else f" with {quantization} weights"
    return Pick(None, None, f"no shipped schedule is for {spec.name} tp={tp} on {gpu_name}{kv} "
                            f"(shipped: {names})")
