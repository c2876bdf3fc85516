"""Where the tests find the repository's files, wherever a test module sits under tests/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root
DATA = ROOT / "tests" / "data"  # small configs and schedules the tests read
PROFILES = ROOT / "nanosched" / "profiler" / "profiles"  # the shipped profiles
