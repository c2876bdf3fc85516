"""The SM step of the copy-engine all-reduce: x += the peers' rows, on a bounded grid.

`reduce_rows(x, rows, max_ctas)`: x [n] (contiguous) += rows[0] + ... + rows[P-1] (rows [P, >= n],
row stride given), accumulated in fp32 and rounded once, as `ce_allreduce.reduce_reference`.
min(blocks, max_ctas) persistent programs loop over `BLOCK`-element blocks (grid stride), so a
caller that gives the all-reduce a CTA bound keeps it off the SMs of the GEMM beside it; None
launches one program per block. The grid depends only on n: CUDA-graph capturable.

Imports triton at module level: import it only where a GPU runs it (ce_allreduce.make_all_reduce).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per work item: 8 KB of bf16 per row and load


@triton.jit
def _reduce_rows_kernel(x_ptr, rows_ptr, row_stride, n, NUM_ROWS: tl.constexpr,
                        BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs0 = tl.arange(0, BLOCK)
    for blk in range(pid, tl.cdiv(n, BLOCK), step):
        offs = tl.cast(blk, tl.int64) * BLOCK + offs0
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        acc = x.to(tl.float32)
        for j in tl.static_range(NUM_ROWS):
            acc += tl.load(rows_ptr + j * row_stride + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_ptr + offs, acc.to(x.dtype), mask=mask)


def reduce_rows(x: torch.Tensor, rows: torch.Tensor, max_ctas: int | None = None) -> None:
    """x [n] += sum of rows[:, :n] in fp32 (see the module docstring)."""
    n = x.numel()
    if n == 0:
        return
    blocks = triton.cdiv(n, BLOCK)
    grid = blocks if max_ctas is None else max(1, min(blocks, max_ctas))
    _reduce_rows_kernel[(grid,)](x, rows, rows.stride(0), n, NUM_ROWS=rows.shape[0], BLOCK=BLOCK,
                                 num_warps=8)
