"""The periodic line `nanosched serve` logs, as vLLM's: prompt and generation throughput since
the last line, running and waiting requests, and the share of KV pages in use.

`StatsLogger(worker, interval_s)` reads only `EngineWorker.snapshot()` (no lock on the engine);
its thread wakes every `interval_s` seconds and logs one line when something ran since the last
one, or requests are running or waiting (an idle server stays quiet). `--stats-interval 0`
turns it off.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("nanosched.serve")
DEFAULT_STATS_INTERVAL_S = 5.0


class StatsLogger:
    """Logs `line()` every `interval_s` seconds from a thread (see the module docstring)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], interval_s: float,
                 emit: Callable[[str], None] = log.info,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.snapshot, self.interval_s, self.emit, self.clock = snapshot, interval_s, emit, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="nanosched-stats", daemon=True)
        self._last = self._counts(snapshot())
        self._last_t = clock()

    @staticmethod
    def _counts(s: dict[str, Any]) -> tuple[int, int]:
        return s["prompt_tokens_processed"], s["tokens_generated"]

    def line(self) -> str | None:
        """The line for the time since the previous call (None when nothing ran and nothing
        waits); advances the window."""
        s, now = self.snapshot(), self.clock()
        prompt, gen = self._counts(s)
        dt = max(now - self._last_t, 1e-9)
        d_prompt, d_gen = prompt - self._last[0], gen - self._last[1]
        self._last, self._last_t = (prompt, gen), now
        if not (d_prompt or d_gen or s["requests_running"] or s["queue_length"]):
            return None
        kv = 100 * s["kv_pages_in_use"] / max(1, s["kv_pages_total"])
        return (f"Avg prompt throughput: {d_prompt / dt:.1f} tokens/s, Avg generation "
                f"throughput: {d_gen / dt:.1f} tokens/s, Running: {s['requests_running']} "
                f"reqs, Waiting: {s['queue_length']} reqs, KV cache usage: {kv:.1f}%")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _main(self) -> None:
        while not self._stop.wait(self.interval_s):
            text = self.line()
            if text is not None:
                self.emit(text)
