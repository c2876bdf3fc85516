"""Persistent Triton GEMM whose program count and tiles are launch arguments.

`persistent_linear(x, w, bias, out, config)` computes out = x @ w.T (+ bias) with
`config.num_sms` programs that walk the output tiles in GROUP_M-swizzled order (each program
takes tiles pid, pid + NUM_SMS, ...). Bounding NUM_SMS bounds the SMs the GEMM occupies, so a
GEMM sized for a green-context partition or beside a CTA-bounded memory kernel is one launch
argument away (docs/measurements.md compares it with cuBLAS on partitions). With e4m3 x and w
and their row and channel scales it is the W8A8 GEMM of `reference.linear_fp8`. Reference:
`reference.linear`.

Imports triton at module level: import this module only through `nanosched.kernels.dispatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanosched.errors import ConfigError
from nanosched.kernels.common import dot_precision, num_sms


@dataclass(frozen=True)
class GemmConfig:
    """Launch arguments of the persistent GEMM; num_sms None means every SM of the device."""

    num_sms: int | None = None
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


@triton.jit
def _persistent_gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, xs_ptr, ws_ptr, M, N, K,
                            s_am, s_ak, s_bk, s_bn, s_cm, s_cn,
                            HAS_BIAS: tl.constexpr, SCALED: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                            DOT_PREC: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    tiles_per_group = GROUP_M * num_pid_n
    offs_k0 = tl.arange(0, BLOCK_K)
    for tile in range(pid, num_tiles, tl.num_programs(0)):  # NUM_SMS programs
        first_m = (tile // tiles_per_group) * GROUP_M
        group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % tiles_per_group) % group_size
        pid_n = (tile % tiles_per_group) // group_size
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + offs_k0
            k_mask = offs_k < K
            a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * s_am + offs_k[None, :] * s_ak,
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
            b = tl.load(b_ptr + offs_k[:, None] * s_bk + offs_n[None, :].to(tl.int64) * s_bn,
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        if SCALED:  # W8A8: each row's activation scale times each output channel's
            xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)  # [BM]
            wsc = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)  # [BN]
            acc = acc * xs[:, None] * wsc[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        c = c_ptr + offs_m[:, None].to(tl.int64) * s_cm + offs_n[None, :] * s_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def persistent_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                      out: torch.Tensor, config: GemmConfig | None = None,
                      x_scale: torch.Tensor | None = None,
                      w_scale: torch.Tensor | None = None) -> None:
    """out = x @ w.T (+ bias) on a persistent grid. x [M, K], w [N, K], out [M, N]. W8A8:
    x and w e4m3 with x_scale [M] and w_scale [N] fp32 (`reference.linear_fp8`'s contract),
    the e4m3 products summed in fp32 and scaled before the bias."""
    scaled = x_scale is not None
    if scaled != (w_scale is not None) or (scaled and (
            x_scale.shape != (x.shape[0],) or w_scale.shape != (w.shape[0],))):
        raise ConfigError(f"persistent_linear: x_scale and w_scale must both be given, as "
                         f"[{x.shape[0]}] and [{w.shape[0]}], or neither")
    cfg = config or GemmConfig()
    m, k = x.shape
    n = w.shape[0]
    if m == 0:
        return
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = min(cfg.num_sms or num_sms(x.device), tiles)
    b = w.t()  # [K, N] view
    _persistent_gemm_kernel[(programs,)](
        x, b, out, bias if bias is not None else out, x_scale if scaled else out,
        w_scale if scaled else out, m, n, k,
        x.stride(0), x.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, SCALED=scaled, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PREC=dot_precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
