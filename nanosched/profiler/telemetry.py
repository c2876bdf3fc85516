"""SM clock and board power of one GPU, sampled on a background thread through NVML (pynvml).

Under a power cap the SM clock depends on what ran in the last few hundred milliseconds, so a
timing means little without the clock it ran at. `Telemetry` samples the SM clock (MHz) and the
board power (W) every `interval_s` while it is started; `reading(t0, t1)` averages the samples
taken between two `time.perf_counter()` marks of the host. A GPU window is placed on the host
clock by its end (after a synchronize) and its GPU-measured length, so a window of a few tens of
milliseconds or more is read faithfully at a 5 ms sampling interval.

`nvmlDeviceGetPowerUsage` is the board power NVML reports (averaged by the driver over a short
window); where the driver has the instantaneous field (`NVML_FI_DEV_POWER_INSTANT`) that is read
instead. GPU-only in practice; without pynvml `open_telemetry` returns None and callers record
no clock (a profile made so says it in its notes).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

SAMPLE_INTERVAL_S = 0.005


@dataclass(frozen=True)
class Reading:
    """Mean SM clock and board power over a window, and how many samples made them."""

    clock_mhz: float
    power_w: float
    samples: int

    def to_json(self) -> dict[str, Any]:
        return {"clock_mhz": round(self.clock_mhz, 1), "power_w": round(self.power_w, 1),
                "samples": self.samples}


def _nvml_handle(index: int) -> tuple[Any, Any]:
    """(pynvml, handle) of CUDA device `index`, matched by PCI bus id when torch knows it."""
    import pynvml

    pynvml.nvmlInit()
    try:
        import torch

        props = torch.cuda.get_device_properties(index)
        bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        return pynvml, pynvml.nvmlDeviceGetHandleByPciBusId(bus)
    except Exception:  # noqa: BLE001 - fall back to NVML's own index order
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)


class Telemetry:
    """Background sampler of (host time, SM clock MHz, board power W)."""

    def __init__(self, index: int, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.nvml, self.handle = _nvml_handle(index)
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, float]] = []
        self._lock = threading.Lock()
        self._instant = self._instant_field()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _instant_field(self) -> int | None:
        field = getattr(self.nvml, "NVML_FI_DEV_POWER_INSTANT", None)
        if field is None:
            return None
        try:
            value = self.nvml.nvmlDeviceGetFieldValues(self.handle, [field])[0]
        except Exception:  # noqa: BLE001 - older drivers lack the field
            return None
        return field if value.nvmlReturn == 0 else None

    @property
    def power_source(self) -> str:
        return "instant" if self._instant is not None else "average"

    def sample(self) -> tuple[float, float, float]:
        """One (host time, SM clock MHz, board power W) now."""
        clock = self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM)
        if self._instant is not None:
            value = self.nvml.nvmlDeviceGetFieldValues(self.handle, [self._instant])[0]
            power_mw = value.value.uiVal
        else:
            power_mw = self.nvml.nvmlDeviceGetPowerUsage(self.handle)
        return time.perf_counter(), float(clock), power_mw / 1e3

    def _loop(self) -> None:
        while not self._stop.is_set():
            sample = self.sample()
            with self._lock:
                self.samples.append(sample)
            time.sleep(self.interval_s)

    def start(self) -> Telemetry:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="telemetry", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def reading(self, t0: float, t1: float) -> Reading | None:
        """Mean clock and power of the samples taken in [t0, t1] (None when none was)."""
        with self._lock:
            inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return None
        return Reading(statistics.fmean(s[1] for s in inside),
                       statistics.fmean(s[2] for s in inside), len(inside))


def open_telemetry(index: int, interval_s: float = SAMPLE_INTERVAL_S) -> Telemetry | None:
    """A started Telemetry of CUDA device `index`, or None when NVML is not available."""
    try:
        return Telemetry(index, interval_s).start()
    except Exception:  # noqa: BLE001 - no pynvml, no driver: the caller records no clock
        return None
