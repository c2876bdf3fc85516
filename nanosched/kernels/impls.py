"""The one vocabulary of implementation names, and the launch-dict contract.

Profile rows, schedules and the runtime name an op's implementation with these strings, so a
schedule that names one is launched exactly as it was measured.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nanosched.errors import ConfigError
from nanosched.kernels.common import PAGED, PIPELINED, PIPELINED_2W, DecodeConfig

GEMM, DECODE, ELEMENTWISE, GROUPED, PREFILL, NETWORK = ("gemm", "decode", "elementwise",
                                                        "grouped", "prefill", "network")
OP_FAMILY = {
    "kqv": GEMM, "o": GEMM, "ug": GEMM, "d": GEMM,
    "attn_decode": DECODE,
    "rope_append": ELEMENTWISE, "add_norm_ffn": ELEMENTWISE, "add_norm_attn": ELEMENTWISE,
    "act": ELEMENTWISE,
    "experts_ug": GROUPED, "experts_d": GROUPED,
    "attn_prefill": PREFILL,
    "ar_attn": NETWORK, "ar_ffn": NETWORK,
}
NARROW = "triton_narrow"  # the W8A8 GEMM and grouped GEMM with the weight as the wide operand
FIXED_NAMES = {
    GEMM: ("cublas", "cublaslt", NARROW),
    DECODE: ("triton_paged", "triton_pipelined", "triton_pipelined_2w", "cuda_bulk", "torch"),
    ELEMENTWISE: ("triton", "torch"),
    GROUPED: ("triton", NARROW, "torch"),  # NARROW: W8A8 only
    PREFILL: ("triton", "torch"),
    NETWORK: ("nccl", "copy_engine"),
}
PERSISTENT = "triton_persistent"
PERSISTENT_PATTERN = re.compile(r"triton_persistent_(\d+)x(\d+)")
TILE_SIZES = (16, 32, 64, 128, 256)
NETWORK_PATTERN = re.compile(r"(nccl|copy_engine)(?:_ctas([1-9]\d*))?")
# partition: the launch runs on a green-context partition of `num_sms` SMs, so an SM target
# (cuBLASLt's carve-out) must not shrink it again
LAUNCH_KEYS = ("impl", "num_sms", "max_ctas", "num_splits", "partition")
DECODE_CONFIGS: dict[str, DecodeConfig] = {"triton_paged": PAGED, "triton_pipelined": PIPELINED,
                                           "triton_pipelined_2w": PIPELINED_2W}
DEFAULT_DECODE = "triton_pipelined"  # what the models launch when no launch dict names one
# ... on an FP8 cache, where `cuda_bulk` can run the call (Hopper, cupy): on all 132 H100 SMs it
# reads e4m3 pages 22-27% faster than triton_pipelined (the FP8 H100 profile, 128-896 requests,
# contexts 512-1,536), while on a bf16 cache the two are within 3% (triton_pipelined ahead on
# small batches), so bf16 keeps the Triton kernel. "auto" in `KernelOptions.decode_impl`.
AUTO_DECODE = "auto"
# decode rows of a batch that share prefix pages run kernels/cascade_attn.py (the prefix read
# once per tile of rows); a batch without such rows runs what "auto" picks. An option, not an
# implementation name: it needs the batch's groups (models/cascade.py), which a launch lacks.
CASCADE_DECODE = "cascade"
# what `KernelOptions.decode_impl` may name
DECODE_OPTIONS = (AUTO_DECODE, *DECODE_CONFIGS, CASCADE_DECODE)
BULK_DECODE = "cuda_bulk"
# programs per SM of each elementwise Triton kernel when a launch bounds SMs but not CTAs
# (rms_norm_add: 8 warps a row; silu_mul: 4 warps a 2048-wide chunk; rope_append: 8 warps a
# token): the best or near it of 1-16 on partitions of 16-64 SMs, and on all SMs as fast as
# one program per work item (docs/measurements.md, bench/kernels/kernels_elementwise.py)
ELEMENTWISE_CTAS_PER_SM = {"rms_norm_add": 4, "silu_mul": 8, "rope_append": 4}


@dataclass(frozen=True)
class GemmImpl:
    """A parsed GEMM implementation name: kind, and tiles for the persistent Triton GEMM."""

    kind: str  # cublas | cublaslt | triton_narrow (W8A8, <= 256 rows) | triton_persistent
    block_m: int = 0
    block_n: int = 0


def persistent_name(block_m: int, block_n: int) -> str:
    """The name of the persistent Triton GEMM with BLOCK_M x BLOCK_N tiles."""
    return f"{PERSISTENT}_{block_m}x{block_n}"


def known_names(family: str) -> str:
    """The names of a family, for error messages."""
    names = list(FIXED_NAMES[family])
    if family == GEMM:
        names.append(f"{PERSISTENT}_<BM>x<BN> (BM, BN in {TILE_SIZES})")
    if family == NETWORK:
        names.append("either with _ctas<k>")
    return ", ".join(names)


def parse_gemm(name: str) -> GemmImpl:
    """Parse a GEMM implementation name; ConfigError names it and the known ones."""
    if name in FIXED_NAMES[GEMM]:
        return GemmImpl(name)
    match = PERSISTENT_PATTERN.fullmatch(name)
    if match:
        bm, bn = int(match[1]), int(match[2])
        if bm in TILE_SIZES and bn in TILE_SIZES:
            return GemmImpl(PERSISTENT, bm, bn)
    raise ConfigError(f"GEMM implementation {name!r} is unknown; known: {known_names(GEMM)}")


def is_known(name: str, family: str) -> bool:
    """Whether `name` is an implementation of `family`."""
    if family == GEMM:
        try:
            parse_gemm(name)
        except ConfigError:
            return False
        return True
    if family == NETWORK:
        return NETWORK_PATTERN.fullmatch(name) is not None
    return name in FIXED_NAMES[family]


def network_impl(name: str | None, max_ctas: int | None = None) -> tuple[str, int | None]:
    """(`nccl` or `copy_engine`, CTA bound or None) of a network implementation name (None:
    `nccl`); the name's `_ctas<k>` wins over `max_ctas`."""
    match = NETWORK_PATTERN.fullmatch(name or "nccl")
    if match is None:
        raise ConfigError(f"network implementation {name!r} is unknown; known: "
                          f"{known_names(NETWORK)}")
    return match[1], int(match[2]) if match[2] else max_ctas


def check_impl(name: str, family: str, what: str = "") -> str:
    """`name` if it belongs to `family`, else a ConfigError naming it and the known names."""
    if family not in FIXED_NAMES:
        raise ConfigError(f"implementation family {family!r} is not one of {tuple(FIXED_NAMES)}")
    if not is_known(name, family):
        raise ConfigError(f"implementation {name!r} is unknown for {what or family}; known: "
                          f"{known_names(family)}")
    return name


def family_of(op: str) -> str | None:
    """The implementation family of layer op `op` (None for ops without one, e.g. all-reduce)."""
    return OP_FAMILY.get(op)


def check_op_impl(op: str, name: str) -> str:
    """`name` if it is an implementation of layer op `op`, else ConfigError."""
    family = family_of(op)
    if family is None:
        raise ConfigError(f"op {op!r} has no implementations to choose; ops that have: "
                          f"{', '.join(OP_FAMILY)}")
    return check_impl(name, family, f"op {op!r}")


def check_any(name: str) -> str:
    """`name` if some family has it, else ConfigError listing every family's names."""
    if not any(is_known(name, f) for f in FIXED_NAMES):
        known = "; ".join(f"{f}: {known_names(f)}" for f in FIXED_NAMES)
        raise ConfigError(f"implementation {name!r} is unknown; known: {known}")
    return name


def applies(op: str, name: str) -> bool:
    """Whether implementation `name` is one of layer op `op`'s."""
    family = family_of(op)
    return family is not None and is_known(name, family)


def read_launch(launch: Mapping[str, Any] | None) -> dict[str, Any]:
    """The launch dict with every key of `LAUNCH_KEYS` (None when absent); rejects others."""
    launch = launch or {}
    bad = [k for k in launch if k not in LAUNCH_KEYS]
    if bad:
        raise ConfigError(f"launch key(s) {bad} not allowed; launch keys: {LAUNCH_KEYS}")
    out = {k: launch.get(k) for k in LAUNCH_KEYS}
    for key in ("num_sms", "max_ctas", "num_splits"):
        if out[key] is not None and (not isinstance(out[key], int) or out[key] < 1):
            raise ConfigError(f"launch {key}={out[key]!r} must be a positive integer")
    if out["partition"] is not None and not isinstance(out["partition"], bool):
        raise ConfigError(f"launch partition={out['partition']!r} must be true or false")
    return out


def sm_target(args: Mapping[str, Any]) -> int | None:
    """The SM count cuBLASLt is told to use: none on a partition (the partition bounds it)."""
    return None if args.get("partition") else args.get("num_sms")


def grid_bound(max_ctas: int | None, num_sms: int | None, ctas_per_sm: int) -> int | None:
    """The grid bound of a persistent kernel (decode attention, elementwise): `max_ctas`, else
    `ctas_per_sm` per SM of `num_sms` (None: the kernel's own default over the device's SMs)."""
    if max_ctas is not None:
        return max_ctas
    return None if num_sms is None else ctas_per_sm * num_sms


def elementwise_ctas(args: Mapping[str, Any], kernel: str) -> int | None:
    """The grid bound of elementwise Triton kernel `kernel` (a key of
    `ELEMENTWISE_CTAS_PER_SM`) under the read launch dict `args`; None: one program per item."""
    return grid_bound(args.get("max_ctas"), args.get("num_sms"), ELEMENTWISE_CTAS_PER_SM[kernel])


def grouped_programs(args: Mapping[str, Any], total_sms: int) -> int | None:
    """The program bound of the grouped Triton GEMM (None: one program per upper-bound tile)."""
    bounds = [] if args.get("max_ctas") is None else [args["max_ctas"]]
    sms = args.get("num_sms")
    if sms is not None and not args.get("partition") and sms < total_sms:
        bounds.append(sms)
    return min(bounds) if bounds else None


def cublaslt_missing() -> str | None:
    """Why this torch cannot give cuBLASLt an SM target, or None."""
    if not hasattr(torch.backends.cuda, "preferred_blas_library"):
        return "torch.backends.cuda.preferred_blas_library is missing in this torch"
    if not hasattr(torch._C, "_set_sm_carveout_experimental"):
        return "torch._C._set_sm_carveout_experimental is missing in this torch"
    return None


@contextlib.contextmanager
def cublaslt_sm_target(sms: int | None, total_sms: int) -> Iterator[None]:
    """cuBLASLt as torch's BLAS, told to use `sms` of `total_sms` SMs; restored on exit."""
    prev_lib = torch.backends.cuda.preferred_blas_library()
    prev_carve = torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    carve = total_sms - sms if sms is not None and sms < total_sms else None
    torch._C._set_sm_carveout_experimental(carve)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(prev_carve)
        torch.backends.cuda.preferred_blas_library(prev_lib)
