"""W8A8 GEMM for decode-sized row counts, with the weight as the wide operand.

`narrow_linear_fp8(x, x_scale, w, w_scale, bias, out, config)` computes `reference.linear_fp8`
for x [M, K] e4m3 with M <= NARROW_MAX_ROWS. Each program takes `block_n` output channels and
every row: it reads its weight slab once and multiplies it by the rows in at most two pieces of
a power of two (128 + 32 for 160 rows), so the tensor cores compute the rows there are plus at
most the second piece's rounding. A GEMM tiled over rows instead (cuBLAS, CUTLASS) computes
whole 128-row tiles: on an H200 under the power cap, torch._scaled_mm at 160 rows costs what
it costs at 256 (docs/quantization.md). `split_k` > 1 shares a slab's K among that many
programs, so that a weight of few channels still reaches every SM; their fp32 partials are
summed, biased and cast by a second kernel. Reference: `reference.linear_fp8`.

Imports triton at module level: import this module only through `nanosched.kernels.dispatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanosched.errors import ConfigError

NARROW_MAX_ROWS = 256
FIRST_PIECE = 128  # rows of the first piece when there are two


@dataclass(frozen=True)
class NarrowConfig:
    """Launch arguments: output channels per program, K step, warps, pipeline stages, and the
    number of programs that share one slab's K."""

    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1


def pieces(m: int) -> tuple[int, int]:
    """The two row pieces (powers of two >= 16; the second 0 when one holds all) of m rows."""
    if not 0 < m <= NARROW_MAX_ROWS:
        raise ConfigError(f"narrow_linear_fp8 takes 1 to {NARROW_MAX_ROWS} rows, not {m}")
    if m <= FIRST_PIECE:
        return max(16, triton.next_power_of_2(m)), 0
    return FIRST_PIECE, max(16, triton.next_power_of_2(m - FIRST_PIECE))


@triton.jit
def _epilogue(acc, rows, offs_n, n_mask, wsc, xs_ptr, bias_ptr, out_ptr, M, s_om,
              HAS_BIAS: tl.constexpr):
    r_mask = rows < M
    xs = tl.load(xs_ptr + rows, mask=r_mask, other=0.0)
    acc = acc * wsc[:, None] * xs[None, :]  # [BN, T]: channels down, rows across
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    ptr = out_ptr + rows[None, :].to(tl.int64) * s_om + offs_n[:, None]
    tl.store(ptr, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & r_mask[None, :])


@triton.jit
def _narrow_fp8_kernel(x_ptr, w_ptr, out_ptr, xs_ptr, ws_ptr, bias_ptr, M, N, K,
                       s_xm, s_wn, s_om, k_per_split, HAS_BIAS: tl.constexpr,
                       EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       T1: tl.constexpr, T2: tl.constexpr):
    # split_k > 1: program (i, j) sums K in [j * k_per_split, (j + 1) * k_per_split) into the
    # fp32 partials out_ptr[j] (M x N, no bias); k_per_split is a multiple of BLOCK_K
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    out_ptr += tl.program_id(1).to(tl.int64) * M * s_om
    n_mask = offs_n < N
    rows1 = tl.arange(0, T1)
    acc1 = tl.zeros([BLOCK_N, T1], dtype=tl.float32)
    if T2 > 0:
        rows2 = T1 + tl.arange(0, T2)
        acc2 = tl.zeros([BLOCK_N, T2], dtype=tl.float32)
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * s_wn
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + kk
        k_ok = (offs_k < k_hi) | EVEN_K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_ok[None, :],
                    other=0.0)  # [BN, BK], K contiguous
        x1 = tl.load(x_ptr + rows1[None, :] * s_xm + offs_k[:, None],
                     mask=(rows1[None, :] < M) & k_ok[:, None], other=0.0)  # [BK, T1]
        acc1 = tl.dot(w, x1, acc1)
        if T2 > 0:
            x2 = tl.load(x_ptr + rows2[None, :] * s_xm + offs_k[:, None],
                         mask=(rows2[None, :] < M) & k_ok[:, None], other=0.0)
            acc2 = tl.dot(w, x2, acc2)
    wsc = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    _epilogue(acc1, rows1, offs_n, n_mask, wsc, xs_ptr, bias_ptr, out_ptr, M, s_om, HAS_BIAS)
    if T2 > 0:
        _epilogue(acc2, rows2, offs_n, n_mask, wsc, xs_ptr, bias_ptr, out_ptr, M, s_om,
                  HAS_BIAS)


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, MN, N, s_om, SPLIT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + j * MN + offs, mask=ok, other=0.0)
    col = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=ok, other=0.0).to(tl.float32)
    ptr = out_ptr + (offs // N).to(tl.int64) * s_om + col
    tl.store(ptr, acc.to(out_ptr.dtype.element_ty), mask=ok)


def split_k_plan(k: int, block_k: int, split_k: int, out: torch.Tensor
                 ) -> tuple[int, int, torch.Tensor]:
    """(splits, K per split (a multiple of block_k), where the programs write) for `split_k`
    programs sharing a K of `k`: `out` itself for one split, else fp32 partials
    [splits, *out.shape] for `sum_splits`."""
    steps = triton.cdiv(k, block_k)
    k_per_split = triton.cdiv(steps, max(1, min(split_k, steps))) * block_k
    split = triton.cdiv(k, k_per_split)
    dest = out if split == 1 else torch.empty((split, *out.shape), dtype=torch.float32,
                                              device=out.device)
    return split, k_per_split, dest


def sum_splits(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = part.sum(0) (+ bias), cast to out's dtype: part [S, M, N] fp32 contiguous, out
    [M, N] with unit stride along N."""
    split, m, n = part.shape
    block = 1024
    _sum_splits_kernel[(triton.cdiv(m * n, block),)](
        part, bias if bias is not None else out, out, m * n, n, out.stride(0), SPLIT=split,
        HAS_BIAS=bias is not None, BLOCK=block)


def narrow_linear_fp8(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                      w_scale: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                      config: NarrowConfig | None = None) -> None:
    """out = (x @ w.T) * x_scale[:, None] * w_scale[None, :] (+ bias): x [M, K] e4m3 with
    M <= NARROW_MAX_ROWS, w [N, K] e4m3, both K-contiguous; x_scale [M], w_scale [N] fp32;
    out [M, N] with unit stride along N."""
    m, k = x.shape
    n = w.shape[0]
    if m == 0:
        return
    if x.stride(1) != 1 or w.stride(1) != 1 or out.stride(1) != 1:
        raise ConfigError("narrow_linear_fp8 needs x and w contiguous along K and out along N")
    if x_scale.shape != (m,) or w_scale.shape != (n,):
        raise ConfigError(f"narrow_linear_fp8: x_scale must be [{m}] and w_scale [{n}], not "
                          f"{list(x_scale.shape)} and {list(w_scale.shape)}")
    t1, t2 = pieces(m)
    cfg = config or NarrowConfig()
    split, k_per_split, dest = split_k_plan(k, cfg.block_k, cfg.split_k, out)
    _narrow_fp8_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, w, dest, x_scale, w_scale, bias if bias is not None else out, m, n, k,
        x.stride(0), w.stride(0), dest.stride(-2), k_per_split,
        HAS_BIAS=bias is not None and split == 1, EVEN_K=k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, T1=t1, T2=t2,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        sum_splits(dest, bias, out)
