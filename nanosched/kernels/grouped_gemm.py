"""Triton grouped GEMM for MoE experts, with a device-side tile schedule (no host sync).

`grouped_linear(x, w, expert_ids, x_rows, out, config)` computes
out[i] = x[x_rows[i]] @ w[expert_ids[i]].T (x_rows None: row i reads x[i]); the contract of
`reference.grouped_linear`. With e4m3 x and w and their scales (one per row of x, one per
expert and output row of w) it is the W8A8 grouped GEMM of `reference.grouped_linear_fp8`:
e4m3 products summed in fp32, both scales applied to the sums. Legend: m = rows, E = experts,
N = output features, K = input features, BM/BN = tile sizes.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanosched.errors import ConfigError
from nanosched.kernels.common import dot_precision


@dataclass(frozen=True)
class GroupedGemmConfig:
    """Launch arguments: tiles, and `num_programs` (None: one program per upper-bound tile).

    The default tile is the fastest of bench/kernels/kernels_moe.py on an H100 at Mixtral-8x7B
    shapes (bench/results/kernels_moe-*.json).
    """

    num_programs: int | None = None
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


# e4m3 operands: a byte an element, so a K-step twice as deep fills the same shared memory
FP8_CONFIG = GroupedGemmConfig(block_k=128)


@dataclass(frozen=True)
class TileSchedule:
    """The device-side schedule of one launch (module docstring): tensors only, no host sync."""

    perm: torch.Tensor  # [m] int64: original row of each sorted row
    offsets: torch.Tensor  # [E + 1] int64: first sorted row of each expert
    tile_end: torch.Tensor  # [E] int64: running sum of the experts' M-tiles
    max_m_tiles: int  # host-known upper bound of tile_end[E - 1]


def tile_schedule(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> TileSchedule:
    """Sort rows by expert and count each expert's M-tiles, on the device (graph-capturable)."""
    sorted_ids, perm = torch.sort(expert_ids, stable=True)
    bounds = torch.arange(num_experts + 1, device=expert_ids.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)  # [E + 1]
    tile_end = torch.cumsum(torch.div(offsets.diff() + block_m - 1, block_m,
                                      rounding_mode="floor"), 0)  # [E]
    m = expert_ids.shape[0]
    return TileSchedule(perm, offsets, tile_end, m // block_m + min(num_experts, m))


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, perm_ptr, offsets_ptr, tile_end_ptr,
                         xs_ptr, wsc_ptr, N, K, E, MAX_M_TILES,
                         s_xm, s_we, s_wn, s_om, s_on, s_se,
                         HAS_ROWS: tl.constexpr, SCALED: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         DOT_PREC: tl.constexpr):
    pid = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    tile_ends = tl.load(tile_end_ptr + offs_e, mask=offs_e < E, other=MAX_M_TILES)  # [BE]
    num_pid_m = tl.max(tl.where(offs_e < E, tile_ends, 0), axis=0)  # real M-tiles
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_pid_n
    offs_k0 = tl.arange(0, BLOCK_K)
    for tile in range(pid, num_pid_m * num_pid_n, tl.num_programs(0)):
        first_m = (tile // tiles_per_group) * GROUP_M
        group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % tiles_per_group) % group_size
        pid_n = (tile % tiles_per_group) // group_size
        is_before = tile_ends <= pid_m  # [BE]: experts whose tiles all precede pid_m
        expert = tl.sum(is_before.to(tl.int32), axis=0)
        first_tile = tl.max(tl.where(is_before, tile_ends, 0), axis=0)  # tile_end[expert - 1]
        row_lo = tl.load(offsets_ptr + expert)
        row_hi = tl.load(offsets_ptr + expert + 1)
        offs_s = row_lo + (pid_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)  # sorted rows
        m_mask = offs_s < row_hi
        rows = tl.load(perm_ptr + offs_s, mask=m_mask, other=0)  # [BM] rows of out
        a_rows = rows  # [BM] rows of x
        if HAS_ROWS:
            a_rows = tl.load(rows_ptr + rows, mask=m_mask, other=0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        a_base = x_ptr + a_rows[:, None].to(tl.int64) * s_xm
        b_base = w_ptr + expert.to(tl.int64) * s_we + offs_n[None, :].to(tl.int64) * s_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + offs_k0
            k_mask = offs_k < K
            a = tl.load(a_base + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)  # [BM, BK]
            b = tl.load(b_base + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :],
                        other=0.0)  # [BK, BN]
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        if SCALED:  # W8A8: the row's activation scale times the expert's channel scale
            xs = tl.load(xs_ptr + a_rows, mask=m_mask, other=0.0)  # [BM]
            wsc = tl.load(wsc_ptr + expert.to(tl.int64) * s_se + offs_n, mask=n_mask,
                          other=0.0)  # [BN]
            acc = acc * xs[:, None] * wsc[None, :]
        c = out_ptr + rows[:, None].to(tl.int64) * s_om + offs_n[None, :] * s_on
        tl.store(c, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def grouped_linear(x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor,
                   x_rows: torch.Tensor | None, out: torch.Tensor,
                   config: GroupedGemmConfig | None = None, x_scale: torch.Tensor | None = None,
                   w_scale: torch.Tensor | None = None) -> None:
    """out[i] = x[x_rows[i]] @ w[expert_ids[i]].T. x [m0, K]; w [E, N, K]; expert_ids [m]
    (values in 0..E-1); x_rows [m] or None (identity); out [m, N], any strides; x and w
    contiguous along K (so that the tile loads are vectorised and pipelined). W8A8: x and w
    e4m3, x_scale [m0] and w_scale [E, N] fp32, each product times x_scale[x_rows[i]] and
    w_scale[expert_ids[i]]."""
    scaled = x_scale is not None
    cfg = config or (FP8_CONFIG if scaled else GroupedGemmConfig())
    m, (num_experts, n, k) = expert_ids.shape[0], w.shape
    if scaled != (w_scale is not None) or (scaled and (
            x_scale.shape != (x.shape[0],) or w_scale.shape != (num_experts, n))):
        raise ConfigError(f"grouped_linear: x_scale "
                          f"{None if x_scale is None else list(x_scale.shape)} and w_scale "
                          f"{None if w_scale is None else list(w_scale.shape)} must both be "
                          f"given, as [{x.shape[0]}] and [{num_experts}, {n}], or neither")
    if out.shape != (m, n) or x.shape[1] != k or (x_rows is not None and x_rows.shape != (m,)):
        raise ConfigError(f"grouped_linear: x {list(x.shape)}, w {list(w.shape)}, expert_ids "
                          f"[{m}], x_rows {None if x_rows is None else list(x_rows.shape)} and "
                          f"out {list(out.shape)} do not fit out[i] = x[x_rows[i]] @ "
                          f"w[expert_ids[i]].T")
    if x.stride(1) != 1 or w.stride(2) != 1:
        raise ConfigError(f"grouped_linear: x (strides {list(x.stride())}) and w (strides "
                          f"{list(w.stride())}) must be contiguous along K")
    if m == 0:
        return
    sched = tile_schedule(expert_ids, num_experts, cfg.block_m)
    tiles = sched.max_m_tiles * triton.cdiv(n, cfg.block_n)
    programs = tiles if cfg.num_programs is None else min(cfg.num_programs, tiles)
    _grouped_gemm_kernel[(programs,)](
        x, w, out, x_rows if x_rows is not None else sched.perm, sched.perm, sched.offsets,
        sched.tile_end, x_scale if scaled else x, w_scale if scaled else w, n, k, num_experts,
        sched.max_m_tiles, x.stride(0), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        w_scale.stride(0) if scaled else 0,
        HAS_ROWS=x_rows is not None, SCALED=scaled, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PREC=dot_precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
