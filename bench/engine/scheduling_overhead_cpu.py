"""CPU cost of the scheduling machinery alone: a Llama-3-8B forward whose ops do nothing.

Runs Sequential, TwoBatchOverlap and Replay(shipped H200 schedule) over a 2,048-token batch
shaped like the schedule's (decode tokens, then two prompt chunks) on `SerialDevice`, so the
time is program building excluded, dispatch + readiness + hazard tracking included: what each
strategy adds to every forward before any kernel is launched. No GPU needed.

    PYTHONPATH=. python bench/engine/scheduling_overhead_cpu.py
"""

from __future__ import annotations

import json
import os
import platform
import time
import types
from pathlib import Path

from nanosched.models.ops import layer_ops
from nanosched.models.spec import load_spec
from nanosched.runtime.backend import Backend
from nanosched.runtime.device import SerialDevice
from nanosched.runtime.modelprogram import model_program
from nanosched.runtime.opsched import run_program
from nanosched.runtime.strategies import Sequential, TwoBatchOverlap
from nanosched.runtime.strategies.replay import Replay
from nanosched.schedules.format import load_schedule

SCHEDULE = "tests/data/llama3-8b-tp1-h200-b2048-single.json"


class NoOpModel:
    """The model interface model_program needs, with ops that do nothing."""

    def __init__(self, spec) -> None:
        self.spec, self.tp = spec, types.SimpleNamespace(size=1)

    def embed(self, *args) -> None:
        pass

    def run_op(self, *args, **kwargs) -> None:
        pass

    def op_names(self) -> list[str]:
        return [op.name for op in layer_ops(self.spec, 1)]


def main() -> None:
    sched = load_schedule(SCHEDULE)
    spec = load_spec(sched.model["name"])
    model, nd = NoOpModel(spec), sched.batch.num_decode
    segments = [(i, i + 1, True) for i in range(nd)] + [(nd, nd + 1024, False),
                                                        (nd + 1024, 2048, False)]
    rows = {}
    for strategy in (Sequential(), TwoBatchOverlap(), Replay(sched, spec.num_layers)):
        program = model_program(model, None, None, segments)
        backend = Backend(SerialDevice())
        run_program(program, strategy, backend)  # warm-up
        t0 = time.perf_counter()
        for _ in range(5):
            run_program(program, strategy, Backend(SerialDevice()))
        rows[strategy.name] = {"ms_per_forward": (time.perf_counter() - t0) / 5 * 1e3,
                               "launches": backend.num_launches}
    out = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "python": platform.python_version(), "schedule": SCHEDULE, "results": rows}
    path = Path(os.environ.get("OUT", "bench/results")) / "scheduling-overhead-cpu.json"
    path.write_text(json.dumps(out, indent=1))
    for name, r in rows.items():
        print(f"{name:>11}: {r['ms_per_forward']:6.1f} ms per forward, {r['launches']} launches")


if __name__ == "__main__":
    main()
