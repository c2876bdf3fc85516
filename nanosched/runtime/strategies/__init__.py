"""Scheduling strategies written in the operator-scheduling API, one short file each."""

from nanosched.runtime.strategies.sequential import Sequential
from nanosched.runtime.strategies.two_batch import TwoBatchOverlap, wave_aware_split

__all__ = ["Sequential", "TwoBatchOverlap", "wave_aware_split"]
