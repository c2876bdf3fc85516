"""Schedules: the `nanosched.schedule/1` contract the search writes and the runtime replays."""

from nanosched.schedules.format import (
    FORMAT,
    Alloc,
    BatchInfo,
    Dep,
    NanoOp,
    Prediction,
    Schedule,
    StageReport,
    StreamInfo,
    check_compatible,
    load_schedule,
    save_schedule,
)

__all__ = ["FORMAT", "Alloc", "BatchInfo", "Dep", "NanoOp", "Prediction", "Schedule",
           "StageReport", "StreamInfo", "check_compatible", "load_schedule", "save_schedule"]
