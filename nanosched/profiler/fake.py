"""`FakeBackend`: a deterministic stand-in for a GPU, for tests and dry runs on a CPU.

Kernel times follow a roofline (`peak_tflops`, `hbm_gbs`) scaled by the SMs or CTAs a row gets;
pairs follow a fixed interference model (`interference`), collectives NCCL's ring formula.
Short timings report the maximum clock, sustained ones (alone or paired) a clock held down by
the power cap (`SUSTAINED_CLOCK`), with kernel times longer by the same ratio; inside a looped
layer GEMMs run slower and the other ops faster, more so the larger the layer. Under
quantization fp8 the layer GEMMs (plan.FP8_GEMM_OPS) run `FP8_GEMM_SPEEDUP` times the bf16 rate
and read e4m3 weights and inputs (a byte each), `o` after a row-quantisation pass over its
input, and the GEMM ceilings are the FP8 GEMM's. It
uses the real implementation registry's names, so a fake profile has the rows a real one has.
`interrupt_after` raises KeyboardInterrupt at that kernel measurement, as Ctrl-C would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanosched.constants import DEFAULT_NUM_SMS
from nanosched.kernels.impls import network_impl
from nanosched.models import ops as optable
from nanosched.models.costmodel import FP8_GEMM_SPEEDUP
from nanosched.models.ops import MEMORY
from nanosched.profiler import impl_registry
from nanosched.profiler.backend import (
    LayerTiming,
    NetworkPair,
    NetworkRequest,
    NetworkResult,
    PairTiming,
    Timing,
    Unsupported,
)
from nanosched.profiler.format import Ceilings, Identity
from nanosched.profiler.network_model import CE_ALL_REDUCE, COLLECTIVE_KINDS, ring_time_us
from nanosched.profiler.plan import (
    FP8_GEMM_OPS,
    ImplInfo,
    KernelTask,
    LayerTask,
    PairTask,
    ProfileSettings,
)
from nanosched.profiler.shapes import GEMM_OPS, gemm_dims, gemm_flops, op_bytes

MAX_CLOCK, SUSTAINED_CLOCK, POWER_LIMIT = 1980.0, 1500.0, 700.0
LAYER_SLOWDOWN, LAYER_L2 = 0.08, 0.15
FAKE_SECONDS = {"row": 0.05, "looped": 1.3, "network": 30.0, "network_pair": 2.0}
IMPL_SPEED = {"cublas": 1.0, "cublaslt": 0.97, "triton_persistent_128x128": 0.93,
              "triton_persistent_128x256": 0.95}  # GEMMs; other ops follow bandwidth


def interference(task: PairTask, num_sms: int) -> tuple[float, float]:
    """(P_compute, P_other) of a pair: a fixed, smooth model of sharing one GPU."""
    share = min(task.other_sms, num_sms) / num_sms
    if task.mechanism == "stream_priority":
        p_c, p_o = 0.87, 0.2 if task.other_class == MEMORY else 0.4
    elif task.mechanism == "green_ctx":
        p_c, p_o = 0.98 * (1 - share), min(1.0, 2.2 * share)
    else:
        p_c = 1 - 0.8 * share if task.compute_sms < num_sms else 0.9 - share / 2
        p_o = min(1.0, 2.5 * share) * (0.8 if task.compute_sms == num_sms else 1.0)
    p_c *= IMPL_SPEED.get(task.compute_impl, 1.0)
    return p_c, p_o * (1 + task.tokens / 1e5)


@dataclass
class FakeBackend:
    gpu_name: str = f"Fake GPU {DEFAULT_NUM_SMS}"
    num_sms: int = DEFAULT_NUM_SMS
    peak_tflops: float = 700.0
    hbm_gbs: float = 3000.0
    gpus: int = 1
    busy_reasons: list[str] = field(default_factory=list)
    interrupt_after: int | None = None
    unsupported: set[str] = field(default_factory=set)  # impl names that refuse to run
    drift: float = 0.0  # relative slow-down of the reference GEMM after the first timing
    calls: list[KernelTask] = field(default_factory=list)
    pair_calls: list[PairTask] = field(default_factory=list)
    sustained_calls: list[KernelTask] = field(default_factory=list)
    layer_calls: list[LayerTask] = field(default_factory=list)
    network_calls: list[NetworkRequest] = field(default_factory=list)
    reference_calls: int = 0
    copy_engine_reason: str | None = None  # why the copy-engine all-reduce cannot run here
    # the implementations (default: profiler/impl_registry.py's; a frontend's)
    registry: Any = None

    def identity(self, command: str) -> Identity:
        return Identity(self.gpu_name, self.num_sms, 80 << 30, "fake", "fake", "fake", "fake",
                        "2026-01-01T00:00:00+00:00", command, MAX_CLOCK, POWER_LIMIT)

    def busy(self) -> list[str]:
        return list(self.busy_reasons)

    def make_partitions(self, small_sides: tuple[int, ...]) -> list[tuple[int, int]]:
        granted = [(-(-s // 8) * 8) for s in small_sides]  # Hopper rounds up to 8 SMs
        return [(s, self.num_sms - s) for s in dict.fromkeys(granted)]

    def implementations(self) -> tuple[dict[str, list[ImplInfo]], list[str]]:
        ops = sorted(optable.OP_FAMILY)  # every op with a kernel on one GPU
        return (self.registry or impl_registry).available(ops)

    def ceilings(self, settings: ProfileSettings) -> Ceilings:
        peak = self.peak_tflops * (FP8_GEMM_SPEEDUP if settings.quantization == "fp8" else 1.0)
        return Ceilings(peak * 1.05, peak, self.hbm_gbs)

    def reference_us(self) -> float:
        self.reference_calls += 1
        return 200.0 * (1 + (self.drift if self.reference_calls > 1 else 0.0))

    def time_kernel(self, settings: ProfileSettings, task: KernelTask) -> Timing:
        if self.interrupt_after is not None and len(self.calls) >= self.interrupt_after:
            raise KeyboardInterrupt
        self.calls.append(task)
        return Timing(self._us(settings, task), MAX_CLOCK, 500.0)

    def time_sustained(self, settings: ProfileSettings, task: KernelTask,
                       estimate_us: float) -> Timing:
        self.sustained_calls.append(task)
        return Timing(self._us(settings, task) * MAX_CLOCK / SUSTAINED_CLOCK, SUSTAINED_CLOCK,
                      POWER_LIMIT)

    def _us(self, settings: ProfileSettings, task: KernelTask) -> float:
        if task.impl in self.unsupported:
            raise Unsupported(f"{task.impl} refuses in this test")
        share = min(task.sms, self.num_sms) / self.num_sms
        if task.mechanism == "cta_bound":
            share = min(1.0, task.sms / 96)  # bandwidth needs CTAs in flight
        spec, tp = settings.model, settings.tp
        fp8 = settings.quantization == "fp8" and task.op in FP8_GEMM_OPS
        flops = gemm_flops(spec, tp, task.op, task.tokens) if task.op in GEMM_OPS else 0.0
        rate = self.peak_tflops * (FP8_GEMM_SPEEDUP if fp8 else 1.0)
        t_c = flops / (rate * 1e6 * share * IMPL_SPEED.get(task.impl, 1.0))
        moved = op_bytes(spec, tp, task.op, task.tokens, task.context)
        bw = self.hbm_gbs * 1e3 * min(1.0, 1.5 * share)
        if not fp8:
            return 3.0 + max(t_c, moved / bw)
        k, n = gemm_dims(spec, tp, task.op)
        moved -= (spec.dtype_bytes - 1) * (k * n + task.tokens * k)  # e4m3 weights and inputs
        t = 3.0 + max(t_c, moved / bw)
        if task.op == optable.O_PROJ:  # its input rows quantised first: model dtype in, e4m3 out
            t += 3.0 + task.tokens * k * (spec.dtype_bytes + 1) / bw
        return t

    def time_pair(self, settings: ProfileSettings, task: PairTask,
                  alone_us: tuple[float, float]) -> PairTiming:
        self.pair_calls.append(task)
        p_c, p_o = interference(task, self.num_sms)
        return PairTiming(alone_us[0] / p_c, alone_us[1] / p_o, SUSTAINED_CLOCK, POWER_LIMIT)

    def time_layer(self, settings: ProfileSettings, task: LayerTask) -> LayerTiming:
        """Inside a layer of T rows GEMMs and prefill attention run slower by up to
        LAYER_SLOWDOWN (the clock falls with T), the other ops faster by up to LAYER_L2."""
        self.layer_calls.append(task)
        share = task.tokens / settings.dense_batch
        times = tuple(self._us(settings, t) * (1 + LAYER_SLOWDOWN * share
                                               if t.op in (*GEMM_OPS, optable.ATTN_PREFILL)
                                               else 1 - LAYER_L2 * share) for t in task.ops)
        return LayerTiming(times, MAX_CLOCK - (MAX_CLOCK - SUSTAINED_CLOCK) * share, POWER_LIMIT)

    def visible_gpus(self) -> int:
        return self.gpus

    def copy_engine_missing(self) -> str | None:
        return self.copy_engine_reason

    def network(self, settings: ProfileSettings, request: NetworkRequest) -> NetworkResult:
        """NCCL by the ring formula; the copy engine at half NCCL's bus bandwidth with a
        longer latency, and its pairs at P_other 0.9 (the shape the 4xH100 bench measured)."""
        self.network_calls.append(request)
        size = settings.model.hidden_size * settings.model.dtype_bytes
        result = NetworkResult(request.world)
        for kind in COLLECTIVE_KINDS:
            for t in request.tokens:
                for c in request.ctas:
                    bw = 230.0 * (min(1.0, c / 16) if c else 1.0)
                    result.times_us[(kind, t, c)] = ring_time_us(kind, t * size, request.world,
                                                                 bw, 8.0)
        for t in request.tokens:
            for c in request.copy_engine_ctas:
                result.times_us[(CE_ALL_REDUCE, t, c)] = ring_time_us(
                    "all_reduce", t * size, request.world, 115.0 * (0.9 if c else 1.0), 40.0)
        for task in request.pairs:
            p_c, p_o = interference(task, self.num_sms)
            c_alone = 50.0 + task.tokens / 10
            impl, ctas = network_impl(task.other_impl)
            if impl == "copy_engine":
                p_o, o_alone = 0.9, result.times_us[(CE_ALL_REDUCE, task.tokens, ctas or 0)]
            else:
                o_alone = result.times_us[("all_reduce", task.tokens, 0)]
            result.pairs.append(NetworkPair(
                task, c_alone, o_alone, PairTiming(c_alone / p_c, o_alone / p_o, SUSTAINED_CLOCK,
                                                   POWER_LIMIT),
                settings.pair_settle_ms, settings.pair_window_ms, SUSTAINED_CLOCK))
        return result

    def clock(self) -> float:
        """Seconds a GPU would have spent on the calls so far (a test's clock for time limits):
        FAKE_SECONDS per kernel row, per looped run, per network start and per network pair."""
        looped = len(self.sustained_calls) + len(self.pair_calls) + len(self.layer_calls)
        pairs = sum(len(r.pairs) for r in self.network_calls)
        return (FAKE_SECONDS["row"] * len(self.calls) + FAKE_SECONDS["looped"] * looped
                + FAKE_SECONDS["network"] * len(self.network_calls)
                + FAKE_SECONDS["network_pair"] * pairs)

    def close(self) -> None:
        pass
