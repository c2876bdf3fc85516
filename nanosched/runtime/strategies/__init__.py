"""Scheduling strategies written in the operator-scheduling API, one short file each.

`NAMED` is the registry of the strategies `--schedule NAME` runs (a schedule file is replayed
by `ReplaySet` instead), keyed by each class's `name` and built by its `for_gpu(num_sms)`: a
new strategy is its file plus its entry here, and nothing else spells its name.
"""

from nanosched.runtime.opsched import OpScheduler
from nanosched.runtime.strategies.sequential import Sequential
from nanosched.runtime.strategies.two_batch import TwoBatchOverlap, wave_aware_split

NAMED: dict[str, type[OpScheduler]] = {s.name: s for s in (Sequential, TwoBatchOverlap)}

__all__ = ["NAMED", "Sequential", "TwoBatchOverlap", "wave_aware_split"]
