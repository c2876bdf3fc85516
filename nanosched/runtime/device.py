"""Streams and events behind one small interface, so the backend runs on a GPU or on the CPU.

`CudaDevice` maps the schedule's streams to CUDA streams (plain, prioritised, or a green-context
partition's stream given by the caller) and orders them with CUDA events. `SerialDevice` runs
every launch at once on the CPU: it has one real order, so events are recorded only to be counted.
`TimedCudaDevice` also records a CUDA event pair around every launch: the per-nano-op timeline
(which nano-op ran when, on which stream) that bench/engine/nanoop_timeline.py compares with a
schedule's prediction. Tests use a device that delays and reorders launches to catch a missing
event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class Device(Protocol):
    def stream(self, name: str) -> Any: ...

    def launch(self, stream: Any, fn: Callable[[], None]) -> None: ...

    def record(self, stream: Any) -> Any: ...

    def wait(self, stream: Any, event: Any) -> None: ...

    def join(self) -> None:
        """Make the default stream wait for everything launched (end of a forward)."""
        ...


class SerialDevice:
    """CPU execution in launch order; counts the events a GPU would need."""

    def __init__(self) -> None:
        self.num_events = 0
        self.num_waits = 0

    def stream(self, name: str) -> str:
        return name

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        fn()

    def record(self, stream: Any) -> int:
        self.num_events += 1
        return self.num_events

    def wait(self, stream: Any, event: Any) -> None:
        self.num_waits += 1

    def join(self) -> None:
        pass


class CudaDevice:
    """CUDA streams per schedule stream name; `streams` may pre-bind names to given streams
    (e.g. green-context partition streams wrapped in `torch.cuda.ExternalStream`)."""

    def __init__(self, streams: dict[str, Any] | None = None,
                 priorities: dict[str, int] | None = None) -> None:
        import torch

        self._torch = torch
        self._streams: dict[str, Any] = dict(streams or {})
        self._priorities = priorities or {}
        self._origin = torch.cuda.current_stream()
        self._current: Any = None  # the stream set current by this forward's launches
        self._used: set[str] = set()
        self.num_events = 0
        self.num_waits = 0

    def stream(self, name: str) -> Any:
        if not self._used:  # a forward starts: it forks from whatever stream is current now
            self._origin = self._torch.cuda.current_stream()  # (a graph's capture stream too)
        if name not in self._streams:
            prio = self._priorities.get(name, 0)
            self._streams[name] = self._torch.cuda.Stream(priority=prio)
        if name not in self._used:  # a stream's first use follows the work before the forward
            self._used.add(name)
            self._streams[name].wait_stream(self._origin)
        return self._streams[name]

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        # switch the current stream only when it changes: a context manager per launch costs
        # tens of microseconds of Python, hundreds of times per forward
        if stream is not self._current:
            self._torch.cuda.set_stream(stream)
            self._current = stream
        fn()

    def record(self, stream: Any) -> Any:
        event = self._torch.cuda.Event()
        event.record(stream)
        self.num_events += 1
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)
        self.num_waits += 1

    def join(self) -> None:
        if self._current is not None:
            self._torch.cuda.set_stream(self._origin)
            self._current = None
        for name in self._used:
            self._origin.wait_stream(self._streams[name])
        self._used.clear()


@dataclass(frozen=True)
class Span:
    """One launch of a timed forward: what ran (the scheduler's label), where, and when."""

    label: str
    stream: str
    start_ms: float  # from the first launch's start
    end_ms: float


class TimedCudaDevice(CudaDevice):
    """A CudaDevice that brackets every launch with timing events (after the launch's waits, so
    a span is the launch's own time on its stream, plus any launch gap the CPU leaves)."""

    wants_labels = True

    def __init__(self, streams: dict[str, Any] | None = None,
                 priorities: dict[str, int] | None = None) -> None:
        super().__init__(streams, priorities)
        self._events: list[tuple[str, Any, Any, Any]] = []

    def launch(self, stream: Any, fn: Callable[[], None], label: str = "") -> None:
        start = self._torch.cuda.Event(enable_timing=True)
        end = self._torch.cuda.Event(enable_timing=True)
        start.record(stream)
        super().launch(stream, fn)
        end.record(stream)
        self._events.append((label, stream, start, end))

    def spans(self) -> list[Span]:
        """The launches so far, in launch order (synchronises the GPU); clears the record."""
        self._torch.cuda.synchronize()
        names = {id(s): n for n, s in self._streams.items()}
        if not self._events:
            return []
        t0 = self._events[0][2]
        out = [Span(label, names.get(id(stream), str(stream)), t0.elapsed_time(a),
                    t0.elapsed_time(b)) for label, stream, a, b in self._events]
        self._events.clear()
        return out
