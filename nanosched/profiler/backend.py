"""The measuring side of the profiler, as an interface: `runner.py` drives a ProfilerBackend.

`gpu_backend.GPUBackend` measures on a CUDA GPU; `fake.FakeBackend` answers from a deterministic
model, so the loop, resume and table building are tested on a CPU. A backend times one task at a
time and never decides what to measure. Times are in microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from nanosched.profiler.format import Ceilings, Identity
from nanosched.profiler.plan import (
    ImplInfo,
    KernelTask,
    LayerTask,
    PairTask,
    ProfileSettings,
)


@dataclass(frozen=True)
class Timing:
    """A measured time and the mean SM clock and board power it ran at (None: not sampled)."""

    us: float
    clock_mhz: float | None = None
    power_w: float | None = None


@dataclass(frozen=True)
class PairTiming:
    """Two kernels timed side by side over one window, and the clock and power of that window."""

    compute_us: float
    other_us: float
    clock_mhz: float | None = None
    power_w: float | None = None


@dataclass(frozen=True)
class LayerTiming:
    """A layer's ops looped in order until the clock settled: each op's median span inside the
    window (in the task's order), and the window's mean clock and power."""

    op_us: tuple[float, ...]
    clock_mhz: float | None = None
    power_w: float | None = None


class Unsupported(Exception):
    """This task cannot run here (too large for memory, shape the kernel rejects); the reason
    is recorded in the profile's notes and the row is left out."""


@dataclass(frozen=True)
class NetworkRequest:
    """Collectives to time on `world` GPUs: every NCCL kind at every token count, with NCCL's
    default CTA count (0) and with each CTA bound; the copy-engine all-reduce with its reduction
    unbounded (0) and bounded to each of `copy_engine_ctas` (empty: not measured); then the
    GEMM x all-reduce pairs, sustained. A request may carry only some of the pairs, and the
    collective rows a former request measured (`times_us`: not timed again)."""

    world: int
    tokens: tuple[int, ...]
    ctas: tuple[int, ...]  # 0 = NCCL's default
    pairs: tuple[PairTask, ...] = ()
    copy_engine_ctas: tuple[int, ...] = ()
    times_us: tuple[tuple[str, int, int, float], ...] = ()  # (kind, tokens, ctas, us)


@dataclass(frozen=True)
class NetworkPair:
    """A GEMM x all-reduce pair: each side alone (the GEMM looped until the clock settled, the
    collective as timed for its row), side by side over a window after `settle_ms`, with the
    window's clock and power."""

    task: PairTask
    compute_alone_us: float
    other_alone_us: float
    timing: PairTiming
    settle_ms: float = 0.0
    window_ms: float = 0.0
    compute_alone_clock_mhz: float | None = None


@dataclass
class NetworkResult:
    world: int
    # (kind, tokens, ctas) -> us; kind one of network_model.OPS_OF_KIND
    times_us: dict[tuple[str, int, int], float] = field(default_factory=dict)
    pairs: list[NetworkPair] = field(default_factory=list)


class ProfilerBackend(Protocol):
    def identity(self, command: str) -> Identity:
        """The GPU, its driver and the software versions measured with."""

    def busy(self) -> list[str]:
        """Why the GPU is not idle (other processes, utilisation, throttling); empty if idle."""

    def make_partitions(self, small_sides: tuple[int, ...]) -> list[tuple[int, int]]:
        """Create disjoint SM partitions; return the (small, rest) SM counts granted."""

    def implementations(self) -> tuple[dict[str, list[ImplInfo]], list[str]]:
        """Per op the implementations that can run here, and notes on those that cannot."""

    def ceilings(self, settings: ProfileSettings) -> Ceilings:
        """GEMM TFLOP/s at 8192^3 and at the model's shapes, HBM copy GB/s."""

    def reference_us(self) -> float:
        """Time of a fixed reference GEMM, re-timed to detect clock drift."""

    def time_kernel(self, settings: ProfileSettings, task: KernelTask) -> Timing:
        """Median time of one kernel row; raises Unsupported."""

    def time_sustained(self, settings: ProfileSettings, task: KernelTask,
                       estimate_us: float) -> Timing:
        """Median time of one kernel looped alone for settings.pair_settle_ms, then timed over
        settings.pair_window_ms (the clock settled under the power cap); raises Unsupported."""

    def time_pair(self, settings: ProfileSettings, task: PairTask,
                  alone_us: tuple[float, float]) -> PairTiming:
        """Both kernels looped side by side for settings.pair_settle_ms, then timed over
        settings.pair_window_ms; `alone_us` sizes the launch queues. Raises Unsupported."""

    def time_layer(self, settings: ProfileSettings, task: LayerTask) -> LayerTiming:
        """The task's ops launched one after another on one stream (each as a CUDA graph of
        its own where it can be captured), over and over, for
        settings.pair_settle_ms, then timed over settings.pair_window_ms, each op's output
        where it can be the next op's input (a forward's L2 reuse). Raises Unsupported, also
        when the CPU could not queue the ops as fast as the GPU ran them."""

    def visible_gpus(self) -> int:
        """GPUs this process can use for network measurements."""

    def copy_engine_missing(self) -> str | None:
        """Why the copy-engine all-reduce cannot run here (no cuda-bindings), or None."""

    def network(self, settings: ProfileSettings, request: NetworkRequest) -> NetworkResult:
        """Time collectives and GEMM x collective pairs on `request.world` GPUs."""

    def close(self) -> None:
        """Release partitions and memory."""
