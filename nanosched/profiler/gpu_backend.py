"""`GPUBackend`: the Backend that measures on a CUDA GPU (GPU-only; imports torch.cuda).

Kernel rows run on the whole GPU (`full`), on a green-context partition's stream (`green_ctx`),
or on the whole GPU with a bounded grid (`cta_bound`). Pairs run the compute kernel and the
memory kernel on two streams: the partitions' (`green_ctx`) or two prioritised streams, the
non-compute kernel's first (`cta_bound`, `stream_priority`), looped for the settings' settle
time and then timed over their window (timing.sustained_run), as are the alone times pairs are
normalised to. A forward table's layer (`time_layer`) runs its ops one after another on one
stream, each captured in a CUDA graph of its own, looped the same way
(timing.sustained_sequence). NVML (telemetry.py) samples the SM clock and board power
throughout; every timing reports their mean over its window. Network work is handed to
network.py's workers.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shlex
import subprocess
import sys
import time
from typing import Any

import torch

from nanosched.greenctx import PartitionPair, split_sms
from nanosched.models import ops as optable
from nanosched.profiler import impl_registry, timing
from nanosched.profiler.backend import (
    LayerTiming,
    NetworkRequest,
    NetworkResult,
    PairTiming,
    Timing,
    Unsupported,
)
from nanosched.profiler.format import Ceilings, Identity
from nanosched.profiler.impl_registry import Kernel, OpCall, ScratchSpace
from nanosched.profiler.plan import (
    ImplInfo,
    KernelTask,
    LayerTask,
    PairTask,
    ProfileSettings,
)
from nanosched.profiler.shapes import gemm_dims
from nanosched.profiler.telemetry import open_telemetry

BUSY_UTIL_PERCENT = 10
STARVED_SHARE = 50  # a layer whose queue ran dry in more than 1 pass of 50 is refused


def _smi(index: int, query: str) -> list[str]:
    out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits",
                          "-i", str(index)], capture_output=True, text=True, timeout=20)
    if out.returncode:
        raise OSError(out.stderr.strip() or f"nvidia-smi exited {out.returncode}")
    return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]


def check_device(index: int) -> None:
    """`--gpu index` names a CUDA device here (checked before a frontend model is built on it,
    and by the backend)."""
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        from nanosched.errors import ConfigError

        raise ConfigError(f"--gpu {index}: no such CUDA device (this process sees "
                          f"{torch.cuda.device_count()})")


class GPUBackend:
    def __init__(self, index: int, rep_ms: float = 10.0, registry: Any = None) -> None:
        """`registry`: the implementations measured (default profiler/impl_registry.py's;
        a frontend model's, nanosched/frontend/profiling.py)."""
        check_device(index)
        self.index = index
        self.registry = registry or impl_registry
        self.device = torch.device("cuda", index)
        torch.cuda.set_device(self.device)
        self.rep_ms = rep_ms
        self.props = torch.cuda.get_device_properties(self.device)
        self.num_sms = self.props.multi_processor_count
        free, _ = torch.cuda.mem_get_info(self.device)
        self.ws = ScratchSpace(self.device, max_bytes=0.35 * free)
        self.pairs: dict[int, PartitionPair] = {}  # by partition SM count -> its pair
        lo, hi = torch.cuda.Stream.priority_range()
        self.high = torch.cuda.Stream(self.device, priority=hi)
        self.low = torch.cuda.Stream(self.device, priority=lo)
        self.max_tokens = 0
        self.telemetry = open_telemetry(index)

    # ---- identity and health -------------------------------------------------------------
    def identity(self, command: str) -> Identity:
        import triton

        try:
            driver = _smi(self.index, "gpu=driver_version")[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            driver = ""
        max_clock = limit = 0.0
        if self.telemetry is not None:
            nvml, handle = self.telemetry.nvml, self.telemetry.handle
            with contextlib.suppress(Exception):
                max_clock = float(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))
            with contextlib.suppress(Exception):
                limit = nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
        return Identity(self.props.name, self.num_sms, self.props.total_memory, driver,
                        torch.version.cuda or "", torch.__version__, triton.__version__,
                        datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        command or shlex.join(sys.argv), max_clock, limit)

    def busy(self) -> list[str]:
        try:
            apps = _smi(self.index, "compute-apps=pid,used_memory")
            util = _smi(self.index, "gpu=utilization.gpu")[0]
        except (OSError, IndexError, subprocess.SubprocessError) as exc:
            return [f"could not ask nvidia-smi whether the GPU is idle ({exc})"]
        out = []
        others = [a for a in apps if a.split(",")[0].strip() != str(os.getpid())]
        if others:
            out.append(f"{len(others)} other process(es) on GPU {self.index}: {'; '.join(others)}")
        if util.isdigit() and int(util) > BUSY_UTIL_PERCENT:
            out.append(f"utilisation {util}% before profiling started")
        reasons = self._throttle_reasons()
        if reasons not in ("", "0x0000000000000000", "0x0000000000000001", "[N/A]"):
            out.append(f"clocks held back by nvidia-smi reasons {reasons}")
        return out

    def _throttle_reasons(self) -> str:
        for field_name in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
            try:
                return _smi(self.index, f"gpu={field_name}")[0]
            except (OSError, IndexError, subprocess.SubprocessError):
                continue
        return ""

    # ---- setup ---------------------------------------------------------------------------
    def make_partitions(self, small_sides: tuple[int, ...]) -> list[tuple[int, int]]:
        granted = []
        for small in small_sides:
            lo, hi = torch.cuda.Stream.priority_range()
            pair = split_sms(self.index, small, small_priority=hi, rest_priority=lo)
            if pair.small.sms in self.pairs or pair.rest.sms in self.pairs:
                pair.close()  # the driver rounded two requests to the same split
                continue
            self.pairs[pair.small.sms] = self.pairs[pair.rest.sms] = pair
            granted.append((pair.small.sms, pair.rest.sms))
        return granted

    def implementations(self) -> tuple[dict[str, list[ImplInfo]], list[str]]:
        return self.registry.available(sorted(optable.OP_FAMILY))  # one GPU's kernels

    def _stream(self, mechanism: str, sms: int) -> Any:
        if mechanism != "green_ctx":
            return torch.cuda.current_stream(self.device)
        pair = self.pairs[sms]
        return pair.small.stream if pair.small.sms == sms else pair.rest.stream

    def _call(self, settings: ProfileSettings, op: str, tokens: int, context: int, sms: int,
              mechanism: str, ws: ScratchSpace | None = None) -> OpCall:
        self.max_tokens = max(self.max_tokens, settings.dense_batch)
        return OpCall(settings.model, settings.tp, op, tokens, context, sms, mechanism,
                      self.num_sms, ws or self.ws, settings.dense_batch, settings.kv_dtype,
                      settings.quantization)

    def _kernel(self, settings: ProfileSettings, op: str, impl: str, tokens: int, context: int,
                sms: int, mechanism: str) -> Kernel:
        call = self._call(settings, op, tokens, context, sms, mechanism)
        try:
            return self.registry.get(op, impl).kernel(call)
        except torch.cuda.OutOfMemoryError as exc:
            self.ws.clear()
            raise Unsupported(f"{op}/{impl} at {tokens} tokens: out of memory") from exc

    # ---- measurements --------------------------------------------------------------------
    def _bench(self, kernel: Kernel, stream: Any, rep_ms: float | None = None) -> float:
        try:
            with kernel.scope(), torch.cuda.stream(stream):
                return timing.bench_us(kernel.fn, self.device, rep_ms or self.rep_ms)
        except torch.cuda.OutOfMemoryError as exc:
            self.ws.clear()
            raise Unsupported(f"out of memory while timing: {exc}") from exc

    def ceilings(self, settings: ProfileSettings) -> Ceilings:
        ws = ScratchSpace(self.device)
        peak = timing.gemm_peak_tflops(self.device, "fp8" if settings.quantization == "fp8"
                                       else "bf16")
        flops = us = 0.0  # under fp8 the model's FP8 GEMMs (`o` with its input's quantisation)
        for op in (o.name for o in optable.OPS
                   if o.family == optable.GEMM and o.holds(settings.model)):
            k, n = gemm_dims(settings.model, settings.tp, op)
            kern = self._kernel(settings, op, "cublas", settings.dense_batch, 0, self.num_sms,
                                "full")
            us += self._bench(kern, torch.cuda.current_stream(self.device), 30)
            flops += 2.0 * settings.dense_batch * k * n
        src = ws.tensor("src", (256 << 20,))  # 512 MiB of bf16
        dst = torch.empty_like(src)
        copy_us = timing.bench_us(lambda: dst.copy_(src), self.device, rep_ms=30, flush=False)
        ws.clear()
        model_tflops = flops / us / 1e6 if us else peak
        return Ceilings(peak, model_tflops, 2 * (512 << 20) / copy_us / 1e3)

    def reference_us(self) -> float:
        a = self.ws.tensor("ref_a", (4096, 4096))
        b = self.ws.tensor("ref_b", (4096, 4096))
        return timing.bench_us(lambda: a @ b, self.device, rep_ms=20, flush=False)

    def _reading(self, t0: float, t1: float) -> tuple[float | None, float | None]:
        r = self.telemetry.reading(t0, t1) if self.telemetry is not None else None
        return (r.clock_mhz, r.power_w) if r is not None else (None, None)

    def time_kernel(self, settings: ProfileSettings, task: KernelTask) -> Timing:
        kern = self._kernel(settings, task.op, task.impl, task.tokens, task.context, task.sms,
                            task.mechanism)
        t0 = time.perf_counter()
        us = self._bench(kern, self._stream(task.mechanism, task.sms))
        return Timing(us, *self._reading(t0, time.perf_counter()))

    def _sustained(self, work: list[tuple[Any, Any, float]],
                   settings: ProfileSettings) -> timing.Sustained:
        try:
            return timing.sustained_run(work, self.device, settings.pair_settle_ms / 1e3,
                                        settings.pair_window_ms / 1e3)
        except torch.cuda.OutOfMemoryError as exc:
            self.ws.clear()
            raise Unsupported(f"out of memory while timing: {exc}") from exc

    def time_sustained(self, settings: ProfileSettings, task: KernelTask,
                       estimate_us: float) -> Timing:
        kern = self._kernel(settings, task.op, task.impl, task.tokens, task.context, task.sms,
                            task.mechanism)
        with kern.scope():
            res = self._sustained([(kern.fn, self._stream(task.mechanism, task.sms),
                                    estimate_us)], settings)
        return Timing(res.median_us[0], *self._reading(*res.host_window))

    def time_pair(self, settings: ProfileSettings, task: PairTask,
                  alone_us: tuple[float, float]) -> PairTiming:
        mech = task.mechanism
        comp = self._kernel(settings, task.compute_op, task.compute_impl, task.tokens, 0,
                            task.compute_sms, "green_ctx" if mech == "green_ctx" else "full")
        other = self._kernel(settings, task.other_op, task.other_impl, task.tokens,
                             task.context, task.other_sms, mech)
        if mech == "green_ctx":
            s_comp, s_other = self._stream(mech, task.compute_sms), self._stream(mech,
                                                                                 task.other_sms)
        else:
            s_comp, s_other = self.low, self.high
        with comp.scope(), other.scope():
            res = self._sustained([(comp.fn, s_comp, alone_us[0]),
                                   (other.fn, s_other, alone_us[1])], settings)
        return PairTiming(res.median_us[0], res.median_us[1], *self._reading(*res.host_window))

    def _graphed(self, fn: Any) -> Any:
        """`fn` captured in a CUDA graph of its own, as its replay: a layer's ops are launched
        a few microseconds apart, as from the engine's graph, not at Python's launch rate,
        which a layer of 512 rows outruns. `fn` itself where it cannot be captured."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()  # compiles and allocates outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError:
            torch.cuda.synchronize(self.device)
            return fn
        return graph.replay

    def time_layer(self, settings: ProfileSettings, task: LayerTask) -> LayerTiming:
        self.ws.clear()  # the layer's tensors live together in a workspace of their own
        torch.cuda.empty_cache()
        ws = ScratchSpace(self.device, max_bytes=self.ws.max_bytes)
        try:
            kernels = self.registry.layer_kernels([(self._call(settings, t.op, t.tokens, t.context,
                                                       t.sms, t.mechanism, ws), t.impl)
                                           for t in task.ops])
            with contextlib.ExitStack() as stack:
                for kern in kernels:
                    stack.enter_context(kern.scope())
                fns = [self._graphed(k.fn) for k in kernels]
                res = timing.sustained_sequence(fns, self.device, settings.pair_settle_ms / 1e3,
                                                settings.pair_window_ms / 1e3)
        except torch.cuda.OutOfMemoryError as exc:
            raise Unsupported(f"layer of {task.tokens} rows: out of memory") from exc
        finally:
            ws.clear()
            torch.cuda.empty_cache()
        if res.starved * STARVED_SHARE > res.passes:
            raise Unsupported(f"layer of {task.tokens} rows: the CPU launched its "
                              f"{len(kernels)} ops slower than the GPU ran them (the queue ran "
                              f"dry {res.starved} times in {res.passes} passes)")
        return LayerTiming(tuple(res.median_us), *self._reading(*res.host_window))

    def visible_gpus(self) -> int:
        return torch.cuda.device_count()

    def copy_engine_missing(self) -> str | None:
        try:
            import triton  # noqa: F401
            from cuda.bindings import driver  # noqa: F401
        except ImportError as err:
            return f"{err.name} is not installed (pip install cuda-bindings triton)"
        return None

    def network(self, settings: ProfileSettings, request: NetworkRequest) -> NetworkResult:
        from nanosched.profiler.network import measure_network

        self.ws.clear()  # leave GPU 0's memory to the worker that runs there
        torch.cuda.empty_cache()
        return measure_network(settings, request, self.num_sms, self.rep_ms)

    def close(self) -> None:
        if self.telemetry is not None:
            self.telemetry.stop()
        for pair in {id(p): p for p in self.pairs.values()}.values():
            with contextlib.suppress(Exception):
                pair.close()
        self.pairs.clear()
        self.ws.clear()
        torch.cuda.empty_cache()
