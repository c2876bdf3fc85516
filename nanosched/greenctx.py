"""Disjoint SM partitions of one GPU: green contexts made with the CUDA driver API.

`split_sms(device_index, small_sms)` asks `cuDevSmResourceSplitByCount` for one group of
`small_sms` SMs (rounded up by the driver to its granularity, 8 on Hopper) and keeps the rest of
the device as the other group; each group gets a green context (`cuGreenCtxCreate`) and a
non-blocking stream in it (`cuGreenCtxStreamCreate`), wrapped as `torch.cuda.ExternalStream`.
Work launched on the two streams runs on disjoint SMs. `GreenPartition.sms` is what the driver
granted. torch's own `GreenContext.create()` is not used: its contexts overlap (docs/design.md).

The profiler and the runtime both use it (a top-level module: no layer owns it). cuda-python
is imported inside functions, through `cuda.bindings.driver` (cuda-python >= 12.6) or the older
`cuda.cuda`. Every CUresult is checked; a failure raises PartitionError naming the driver call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanosched.errors import NanoschedError


class PartitionError(NanoschedError, RuntimeError):
    """A driver call for green contexts failed, or cuda-python is missing."""


def driver() -> Any:
    """The cuda-python driver module."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        try:
            from cuda import cuda as drv  # cuda-python < 12.6
        except ImportError:
            raise PartitionError("green-context partitions need cuda-python: "
                                 "`pip install cuda-bindings` (or cuda-python)") from None
    return drv


def check(drv: Any, result: Any, call: str) -> Any:
    """Unpack a cuda-python result tuple (err, *values); raise on an error code."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        name_err, name = drv.cuGetErrorName(err)
        what = name.decode() if name_err == drv.CUresult.CUDA_SUCCESS else str(err)
        raise PartitionError(f"{call} failed: {what}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@dataclass
class GreenPartition:
    """One green context and its stream; `stream` is what torch code launches on."""

    sms: int
    stream: Any  # torch.cuda.ExternalStream
    _gctx: Any
    _raw_stream: Any

    def close(self) -> None:
        drv = driver()
        check(drv, drv.cuStreamDestroy(self._raw_stream), "cuStreamDestroy")
        check(drv, drv.cuGreenCtxDestroy(self._gctx), "cuGreenCtxDestroy")


@dataclass
class PartitionPair:
    small: GreenPartition
    rest: GreenPartition

    def close(self) -> None:
        self.small.close()
        self.rest.close()


def _green(drv: Any, device: Any, resource: Any, index: int, priority: int) -> GreenPartition:
    import torch

    desc = check(drv, drv.cuDevResourceGenerateDesc([resource], 1), "cuDevResourceGenerateDesc")
    gctx = check(drv, drv.cuGreenCtxCreate(
        desc, device, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate")
    raw = check(drv, drv.cuGreenCtxStreamCreate(
        gctx, drv.CUstream_flags.CU_STREAM_NON_BLOCKING, priority), "cuGreenCtxStreamCreate")
    stream = torch.cuda.ExternalStream(int(raw), device=torch.device("cuda", index))
    return GreenPartition(int(resource.sm.smCount), stream, gctx, raw)


def split_sms(device_index: int, small_sms: int, small_priority: int = 0,
              rest_priority: int = 0) -> PartitionPair:
    """Two disjoint partitions of GPU `device_index`: about `small_sms` SMs and the rest.

    Priorities are CUDA stream priorities (lower is higher; 0 is the default).
    """
    import torch

    torch.cuda.init()
    torch.cuda.set_device(device_index)
    torch.empty(1, device=f"cuda:{device_index}")  # the primary context exists from here on
    drv = driver()
    check(drv, drv.cuInit(0), "cuInit")
    dev = check(drv, drv.cuDeviceGet(device_index), "cuDeviceGet")
    whole = check(drv, drv.cuDeviceGetDevResource(
        dev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource")
    if not 0 < small_sms < int(whole.sm.smCount):
        raise PartitionError(f"cannot split {small_sms} of {int(whole.sm.smCount)} SMs")
    groups, count, rest = check(drv, drv.cuDevSmResourceSplitByCount(1, whole, 0, small_sms),
                                "cuDevSmResourceSplitByCount")
    if int(count) < 1 or int(rest.sm.smCount) < 1:
        raise PartitionError(f"cuDevSmResourceSplitByCount gave {int(count)} group(s) and "
                             f"{int(rest.sm.smCount)} SMs left for {small_sms} SMs requested")
    small = _green(drv, dev, groups[0], device_index, small_priority)
    try:
        other = _green(drv, dev, rest, device_index, rest_priority)
    except PartitionError:
        small.close()
        raise
    return PartitionPair(small, other)
