"""The implementation registry: per op, the named ways to run it that the profiler measures.

Names are those of nanosched/kernels/impls.py (the runtime's vocabulary), and every
implementation launches the model's own kernels through `nanosched.kernels.dispatch` with the
launch dict the runtime would pass for the row (`launch_of`): `{"impl", "num_sms"}` on the whole
GPU or a green-context partition, `{"impl", "max_ctas"}` for `cta_bound`. So a schedule that
names a row's implementation is launched exactly as it was measured.

More in docs/profiler.md, module notes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nanosched.kernels import impls as kernel_impls
from nanosched.models.spec import ModelSpec
from nanosched.profiler.backend import Unsupported
from nanosched.profiler.plan import ImplInfo


@dataclass
class ScratchSpace:
    """Random tensors reused across rows; one live tensor per name (a new shape replaces it)."""

    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    max_bytes: float = float("inf")  # refuse single tensors larger than this
    cache: dict[str, torch.Tensor] = field(default_factory=dict)
    # name -> the cached tensor it is read from instead, viewed to its shape, where dtype and
    # size agree (a layer's op reading the op before it's output)
    aliases: dict[str, str] = field(default_factory=dict)

    def tensor(self, name: str, shape: tuple[int, ...], scale: float = 1.0,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        source = self.cache.get(self.aliases.get(name, ""))
        if source is not None and source.dtype == dtype and source.numel() == math.prod(shape):
            return source.view(shape)
        have = self.cache.get(name)
        if have is not None and tuple(have.shape) == tuple(shape) and have.dtype == dtype:
            return have
        self.cache.pop(name, None)
        numel = 1
        for n in shape:
            numel *= n
        size = numel * torch.finfo(dtype).bits // 8 if dtype.is_floating_point else numel * 8
        if size > self.max_bytes:
            raise Unsupported(f"{name} {list(shape)} needs {size / 2**30:.1f} GiB, more than "
                              f"the {self.max_bytes / 2**30:.1f} GiB free")
        if dtype == torch.float8_e4m3fn:  # no randn in fp8: N(0, scale) rounded to e4m3
            t = torch.randn(shape, device=self.device).mul_(scale).to(dtype)
        elif dtype.is_floating_point:
            t = torch.randn(shape, device=self.device, dtype=dtype).mul_(scale)
        else:
            t = torch.randint(0, 1 << 20, shape, device=self.device, dtype=dtype)
        self.cache[name] = t
        return t

    def clear(self) -> None:
        self.cache.clear()


@dataclass(frozen=True)
class OpCall:
    spec: ModelSpec
    tp: int
    op: str
    tokens: int
    context: int
    sms: int  # SMs of its partition / SM target, or CTAs for cta_bound
    mechanism: str
    num_sms: int
    ws: ScratchSpace
    max_tokens: int = 0  # largest token count of the run: inputs are sliced from one buffer
    kv_dtype: str = "auto"  # KV cache of the attention ops and rope_append (ProfileSettings)
    quantization: str = "none"  # layer weights of the GEMMs and their input kernels (likewise)


@dataclass(frozen=True)
class Kernel:
    fn: Callable[[], Any]
    scope: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


def launch_of(call: OpCall, impl: str) -> dict[str, Any]:
    """The launch dict the runtime passes for a row of `call` with implementation `impl`."""
    if call.mechanism == "cta_bound":
        return {"impl": impl, "max_ctas": call.sms}
    if call.mechanism == "green_ctx":
        return {"impl": impl, "num_sms": call.sms, "partition": True}
    return {"impl": impl, "num_sms": call.sms}


Setup = Callable[[OpCall, dict[str, Any]], Kernel]


@dataclass(frozen=True)
class Impl:
    name: str  # a name of nanosched/kernels/impls.py
    mechanisms: tuple[str, ...]
    setup: Setup  # (call, launch dict) -> Kernel
    quick: bool = True
    targets_sms: bool = False
    requires: Callable[[], str | None] = lambda: None  # why it cannot run here, or None

    def info(self) -> ImplInfo:
        return ImplInfo(self.name, self.mechanisms, self.quick, self.targets_sms)

    def kernel(self, call: OpCall) -> Kernel:
        """Set up this implementation for `call`, launched with the runtime's launch dict."""
        return self.setup(call, launch_of(call, self.name))


REGISTERED_IMPLS: dict[str, list[Impl]] = {}


def register(op: str, impl: Impl) -> None:
    """Add an implementation of `op` (replacing one of the same name); the name must be one of
    the op's in nanosched/kernels/impls.py."""
    kernel_impls.check_op_impl(op, impl.name)
    impls = [i for i in REGISTERED_IMPLS.setdefault(op, []) if i.name != impl.name]
    REGISTERED_IMPLS[op] = impls + [impl]


def available_in(table: dict[str, list[Impl]], ops: list[str]
                 ) -> tuple[dict[str, list[ImplInfo]], list[str]]:
    """Per op the implementations of `table` that can run here, and a note for each that
    cannot (the registry's, or a frontend model's own table)."""
    out: dict[str, list[ImplInfo]] = {}
    notes = []
    for op in ops:
        for impl in table.get(op, []):
            reason = impl.requires()
            if reason:
                notes.append(f"{op}/{impl.name} not measured: {reason}")
            else:
                out.setdefault(op, []).append(impl.info())
    return out, notes


def available(ops: list[str]) -> tuple[dict[str, list[ImplInfo]], list[str]]:
    """Per op the registered implementations that can run here, and a note for each that
    cannot."""
    _ensure_registered()
    return available_in(REGISTERED_IMPLS, ops)


def get(op: str, name: str) -> Impl:
    _ensure_registered()
    for impl in REGISTERED_IMPLS.get(op, []):
        if impl.name == name:
            return impl
    raise KeyError(f"no implementation {name!r} of op {op!r}")


def layer_kernels(calls: list[tuple[OpCall, str]]) -> list[Kernel]:
    """The kernels of a layer's ops (each call with its implementation's name), in order, on
    the calls' one ScratchSpace, each op reading the output of the op before it where
    `impls_kernels.LAYER_FLOW` names one. Set up twice: the first pass creates the outputs
    that the second pass's inputs read (the first op reads the last op's)."""
    _ensure_registered()
    from nanosched.profiler.impls_kernels import LAYER_FLOW

    ws = calls[0][0].ws
    ws.aliases = {}
    for call, name in calls:
        get(call.op, name).kernel(call)
    ws.aliases = dict(LAYER_FLOW)
    return [get(call.op, name).kernel(call) for call, name in calls]


def triton_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def bulk_missing() -> str | None:
    """Why the `cuda_bulk` decode attention cannot run here (it merges splits with Triton)."""
    from nanosched.kernels.decode_attn_bulk import missing_dependency

    return triton_missing() or missing_dependency()


_registered = False


def _ensure_registered() -> None:
    global _registered
    if not _registered:
        _registered = True
        from nanosched.profiler import impls_kernels

        impls_kernels.register_all()
