"""The GPU tests' `%smid` reader (imports triton; GPU only).

- `sm_ids(num_ctas)`: the `%smid` of each program, to check which SMs a stream may use;
- `partition_sm_ids`: which SMs a green-context partition's programs ran on
  (tests/gpu/test_partitions.py checks the partitions are disjoint).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanosched.greenctx import GreenPartition


@triton.jit
def _smid_kernel(out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ids = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [offs], dtype=tl.int32,
                                    is_pure=False, pack=1)
    tl.store(out_ptr + pid + offs, ids, mask=offs < 1)


def sm_ids(num_ctas: int, device: torch.device | str = "cuda") -> set[int]:
    """Ids of the SMs that ran `num_ctas` programs on the current stream (synchronises)."""
    out = torch.full((num_ctas,), -1, dtype=torch.int32, device=device)
    _smid_kernel[(num_ctas,)](out, BLOCK=32, num_warps=1)
    torch.cuda.current_stream().synchronize()
    return set(out.tolist())


def partition_sm_ids(part: GreenPartition, num_ctas: int = 1024) -> set[int]:
    """SM ids that `num_ctas` tiny programs launched on `part`'s stream ran on."""
    with torch.cuda.stream(part.stream):
        return sm_ids(num_ctas, device=part.stream.device)
