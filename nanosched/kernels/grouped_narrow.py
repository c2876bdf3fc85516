"""W8A8 grouped GEMM of MoE experts at decode-sized rows an expert, the weight as the wide operand.

`grouped_narrow_fp8(x, x_scale, w, w_scale, expert_ids, x_rows, out, config)` computes
`reference.grouped_linear_fp8`. Program (j, e) takes `block_n` output channels of expert e and
every row routed to e (the device-side schedule of `grouped_gemm.tile_schedule`: rows sorted by
expert, no host sync): it reads its weight slab once per chunk of `max_rows` rows and multiplies
it by the chunk's rows. The count is known only on the device, so a runtime branch picks, per
chunk, the kernel body for ceil(rows / piece) pieces (1 to max_rows / piece, each a constexpr
specialisation whose rows are at most three power-of-two dots): the tensor cores compute the
rows there are plus less than one piece. An expert without rows runs no K step. A row-tiled
grouped GEMM instead computes whole 128-row tiles and reads the slab once a tile.
`split_k` > 1 shares a slab's K among that many programs; fp32 partials, summed by a second
kernel. Legend: m = rows, E = experts, N = output channels, K = input features, BN = block_n.

Imports triton at module level: import this module only through `nanosched.kernels.dispatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanosched.errors import ConfigError
from nanosched.kernels.gemm_narrow import split_k_plan, sum_splits
from nanosched.kernels.grouped_gemm import tile_schedule

MAX_PIECES = 8  # row pieces of one chunk: at most three dots (4 + 2 + 1 pieces, or 8)


@dataclass(frozen=True)
class GroupedNarrowConfig:
    """Launch arguments: output channels per program, K step, rows of a piece (a power of two
    >= 16), rows of a chunk (a multiple of the piece, at most MAX_PIECES of them), warps,
    pipeline stages, and the number of programs that share one slab's K."""

    block_n: int = 128
    block_k: int = 128
    piece: int = 32
    max_rows: int = 256
    num_warps: int = 8
    num_stages: int = 3
    split_k: int = 1

    def __post_init__(self) -> None:
        pieces = self.max_rows // max(self.piece, 1)
        if (self.piece < 16 or self.piece & (self.piece - 1) or self.max_rows % self.piece
                or not 1 <= pieces <= MAX_PIECES):
            raise ConfigError(f"grouped narrow GEMM: piece {self.piece} must be a power of two "
                              f">= 16 and max_rows {self.max_rows} 1 to {MAX_PIECES} pieces")


@triton.jit
def _x_rows(s_lo, s_hi, perm_ptr, rows_ptr, s_xm, T: tl.constexpr, HAS_ROWS: tl.constexpr):
    """Row offsets [T] into x of sorted rows s_lo + 0..T-1, and which are below s_hi."""
    s = s_lo + tl.arange(0, T)
    ok = s < s_hi
    rows = tl.load(perm_ptr + s, mask=ok, other=0)
    if HAS_ROWS:
        rows = tl.load(rows_ptr + rows, mask=ok, other=0)
    return rows.to(tl.int64) * s_xm, ok


@triton.jit
def _store(acc, s_lo, s_hi, offs_n, n_mask, wsc, rows_ptr, perm_ptr, xs_ptr, out_ptr, s_om,
           T: tl.constexpr, HAS_ROWS: tl.constexpr):
    """Scale acc [BN, T] (channels down, rows across) of sorted rows s_lo + 0..T-1 (those below
    s_hi) by both scales and store it to their rows of out."""
    s = s_lo + tl.arange(0, T)
    ok = s < s_hi
    rows = tl.load(perm_ptr + s, mask=ok, other=0)  # rows of out
    a_rows = rows
    if HAS_ROWS:
        a_rows = tl.load(rows_ptr + rows, mask=ok, other=0)  # rows of x
    xs = tl.load(xs_ptr + a_rows, mask=ok, other=0.0)
    acc = acc * wsc[:, None] * xs[None, :]
    ptr = out_ptr + rows[None, :].to(tl.int64) * s_om + offs_n[:, None]
    tl.store(ptr, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & ok[None, :])


@triton.jit
def _chunk(x_ptr, w_rows, out_ptr, rows_ptr, perm_ptr, xs_ptr, wsc, offs_n, n_mask, s_lo, s_hi,
           k_lo, k_hi, s_xm, s_om, HAS_ROWS: tl.constexpr, EVEN_K: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TA: tl.constexpr, TB: tl.constexpr,
           TC: tl.constexpr):
    """Sorted rows [s_lo, min(s_hi, s_lo + TA + TB + TC)) times the slab w_rows, K in
    [k_lo, k_hi): the slab read once, each non-empty row piece (TA, TB, TC rows: 0 or a power
    of two) one dot a K step."""
    kk = tl.arange(0, BLOCK_K)
    if TA > 0:
        xa, oka = _x_rows(s_lo, s_hi, perm_ptr, rows_ptr, s_xm, TA, HAS_ROWS)
        acc_a = tl.zeros([BLOCK_N, TA], dtype=tl.float32)
    if TB > 0:
        xb, okb = _x_rows(s_lo + TA, s_hi, perm_ptr, rows_ptr, s_xm, TB, HAS_ROWS)
        acc_b = tl.zeros([BLOCK_N, TB], dtype=tl.float32)
    if TC > 0:
        xc, okc = _x_rows(s_lo + TA + TB, s_hi, perm_ptr, rows_ptr, s_xm, TC, HAS_ROWS)
        acc_c = tl.zeros([BLOCK_N, TC], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + kk
        k_ok = (offs_k < k_hi) | EVEN_K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_ok[None, :],
                    other=0.0)  # [BN, BK], K contiguous
        if TA > 0:
            a = tl.load(x_ptr + xa[None, :] + offs_k[:, None],
                        mask=oka[None, :] & k_ok[:, None], other=0.0)  # [BK, TA]
            acc_a = tl.dot(w, a, acc_a)
        if TB > 0:
            b = tl.load(x_ptr + xb[None, :] + offs_k[:, None],
                        mask=okb[None, :] & k_ok[:, None], other=0.0)
            acc_b = tl.dot(w, b, acc_b)
        if TC > 0:
            c = tl.load(x_ptr + xc[None, :] + offs_k[:, None],
                        mask=okc[None, :] & k_ok[:, None], other=0.0)
            acc_c = tl.dot(w, c, acc_c)
    if TA > 0:
        _store(acc_a, s_lo, s_hi, offs_n, n_mask, wsc, rows_ptr, perm_ptr, xs_ptr, out_ptr,
               s_om, TA, HAS_ROWS)
    if TB > 0:
        _store(acc_b, s_lo + TA, s_hi, offs_n, n_mask, wsc, rows_ptr, perm_ptr, xs_ptr, out_ptr,
               s_om, TB, HAS_ROWS)
    if TC > 0:
        _store(acc_c, s_lo + TA + TB, s_hi, offs_n, n_mask, wsc, rows_ptr, perm_ptr, xs_ptr,
               out_ptr, s_om, TC, HAS_ROWS)


@triton.jit
def _grouped_narrow_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, perm_ptr, offsets_ptr, xs_ptr,
                           wsc_ptr, M, N, K, s_xm, s_we, s_wn, s_om, s_se, k_per_split,
                           HAS_ROWS: tl.constexpr, EVEN_K: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIECE: tl.constexpr,
                           NUM_PIECES: tl.constexpr):
    # split_k > 1: program (j, e, s) sums K in [s * k_per_split, (s + 1) * k_per_split) into the
    # fp32 partials out_ptr[s] (M x N); k_per_split is a multiple of BLOCK_K
    expert = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    out_ptr += tl.program_id(2).to(tl.int64) * M * s_om
    row_lo = tl.load(offsets_ptr + expert)
    row_hi = tl.load(offsets_ptr + expert + 1)
    w_rows = w_ptr + expert.to(tl.int64) * s_we + offs_n[:, None].to(tl.int64) * s_wn
    wsc = tl.load(wsc_ptr + expert.to(tl.int64) * s_se + offs_n, mask=n_mask, other=0.0)
    for s_lo in range(row_lo, row_hi, PIECE * NUM_PIECES):  # chunks; none without rows
        s_hi = tl.minimum(row_hi, s_lo + PIECE * NUM_PIECES)
        num = tl.cdiv(s_hi - s_lo, PIECE)  # pieces this chunk needs, 1..NUM_PIECES
        for p in tl.static_range(1, NUM_PIECES + 1):
            if num == p:  # p pieces as dots of 4 (8 when p = 8), 2 and 1 pieces
                _chunk(x_ptr, w_rows, out_ptr, rows_ptr, perm_ptr, xs_ptr, wsc, offs_n,
                       n_mask, s_lo, s_hi, k_lo, k_hi, s_xm, s_om, HAS_ROWS, EVEN_K, BLOCK_N,
                       BLOCK_K, PIECE * 4 * (p // 4), PIECE * 2 * (p // 2 % 2), PIECE * (p % 2))


def grouped_narrow_fp8(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                       w_scale: torch.Tensor, expert_ids: torch.Tensor,
                       x_rows: torch.Tensor | None, out: torch.Tensor,
                       config: GroupedNarrowConfig | None = None) -> None:
    """out[i] = (x[r] @ w[e].T) * x_scale[r] * w_scale[e], r = x_rows[i] (i when None) and
    e = expert_ids[i]. x [m0, K] and w [E, N, K] e4m3, both K-contiguous; x_scale [m0] and
    w_scale [E, N] fp32; expert_ids [m]; x_rows [m] or None; out [m, N], unit stride along N."""
    cfg = config or GroupedNarrowConfig()
    m, (num_experts, n, k) = expert_ids.shape[0], w.shape
    if x_scale.shape != (x.shape[0],) or w_scale.shape != (num_experts, n):
        raise ConfigError(f"grouped_narrow_fp8: x_scale must be [{x.shape[0]}] and w_scale "
                          f"[{num_experts}, {n}], not {list(x_scale.shape)} and "
                          f"{list(w_scale.shape)}")
    if out.shape != (m, n) or x.shape[1] != k or (x_rows is not None and x_rows.shape != (m,)):
        raise ConfigError(f"grouped_narrow_fp8: x {list(x.shape)}, w {list(w.shape)}, "
                          f"expert_ids [{m}], x_rows "
                          f"{None if x_rows is None else list(x_rows.shape)} and out "
                          f"{list(out.shape)} do not fit out[i] = x[x_rows[i]] @ "
                          f"w[expert_ids[i]].T")
    if x.stride(1) != 1 or w.stride(2) != 1 or out.stride(1) != 1:
        raise ConfigError("grouped_narrow_fp8 needs x and w contiguous along K and out along N")
    if m == 0:
        return
    sched = tile_schedule(expert_ids, num_experts, cfg.max_rows)
    split, k_per_split, dest = split_k_plan(k, cfg.block_k, cfg.split_k, out)
    _grouped_narrow_kernel[(triton.cdiv(n, cfg.block_n), num_experts, split)](
        x, w, dest, x_rows if x_rows is not None else sched.perm, sched.perm, sched.offsets,
        x_scale, w_scale, m, n, k, x.stride(0), w.stride(0), w.stride(1), dest.stride(-2),
        w_scale.stride(0), k_per_split, HAS_ROWS=x_rows is not None,
        EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PIECE=cfg.piece, NUM_PIECES=cfg.max_rows // cfg.piece, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if split > 1:
        sum_splits(dest, None, out)
