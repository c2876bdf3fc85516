"""The profiler's own Triton kernels, each with a bounded grid (GPU-only module: imports triton).

- `persistent_linear(x, w, out, num_sms)`: out = x @ w.T with exactly min(num_sms, tiles)
  programs, each looping over tiles: a GEMM told how many SMs it may occupy.
- `decode_attention(q, k, v, out, num_ctas)`: one query token per request, GQA, over contiguous
  K/V [T, Hkv, C, d]; `num_ctas` programs loop over the (request, KV head) work items, so the
  memory-bound kernel's SM footprint is bounded by its grid.
- `sm_ids(num_ctas)`: the `%smid` of each program, to check which SMs a stream may use.

Correct in fp32/fp16 under TRITON_INTERPRET=1 on a CPU (tests/test_profiler_kernels.py); bf16
is checked on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _persistent_linear_kernel(x_ptr, w_ptr, o_ptr, M, N, K, s_xm, s_xk, s_wn, s_wk, s_om, s_on,
                              num_programs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    rk = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), tiles_m * tiles_n, num_programs):
        first_m = (tile // in_group) * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pm = first_m + (tile % in_group) % size_m
        pn = (tile % in_group) // size_m
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * s_xm + kk[None, :] * s_xk,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * s_wn + kk[:, None] * s_wk,
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(a, b, acc)
        tl.store(o_ptr + rm[:, None] * s_om + rn[None, :] * s_on,
                 acc.to(o_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def persistent_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, num_sms: int,
                      block_m: int = 128, block_n: int = 128, block_k: int = 64,
                      num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """out [M, N] = x [M, K] @ w [N, K].T on at most `num_sms` programs."""
    M, K = x.shape
    N = w.shape[0]
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    grid = max(1, min(num_sms, tiles))
    _persistent_linear_kernel[(grid,)](
        x, w, out, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0),
        out.stride(1), grid, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        num_warps=num_warps, num_stages=num_stages)
    return out


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, num_work, num_kv_heads, context, scale,
                   s_qt, s_qh, s_kt, s_kh, s_kc, s_ot, s_oh, num_programs,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    rg = tl.arange(0, GROUP_PAD)
    rd = tl.arange(0, HEAD_DIM)
    rn = tl.arange(0, BLOCK_N)
    is_head = rg[:, None] < GROUP
    for work in range(tl.program_id(0), num_work, num_programs):
        t = (work // num_kv_heads).to(tl.int64)  # T * Hkv * C * d passes 2^31 at 1.5K x 1.5K
        kvh = work % num_kv_heads
        qh = kvh * GROUP + rg
        q = tl.load(q_ptr + t * s_qt + qh[:, None] * s_qh + rd[None, :], mask=is_head,
                    other=0.0)
        m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        denom = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
        kv_off = t * s_kt + kvh * s_kh
        for n0 in range(0, context, BLOCK_N):
            cols = n0 + rn
            in_ctx = cols[:, None] < context
            kb = tl.load(k_ptr + kv_off + cols[:, None] * s_kc + rd[None, :], mask=in_ctx,
                         other=0.0)
            s = tl.dot(q, tl.trans(kb)) * scale
            s = tl.where(cols[None, :] < context, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            vb = tl.load(v_ptr + kv_off + cols[:, None] * s_kc + rd[None, :], mask=in_ctx,
                         other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
            m = m_new
        out = acc / denom[:, None]
        tl.store(o_ptr + t * s_ot + qh[:, None] * s_oh + rd[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=is_head)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     num_ctas: int, block_n: int = 64, num_warps: int = 4) -> torch.Tensor:
    """out [T, Hq, d] = softmax(q K^T / sqrt(d)) V per request, K/V [T, Hkv, C, d] contiguous,
    on at most `num_ctas` programs."""
    T, Hq, d = q.shape
    _, Hkv, C, _ = k.shape
    if k.stride(3) != 1 or q.stride(2) != 1 or k.stride() != v.stride():
        raise ValueError("decode_attention needs contiguous head dims and K, V of one layout")
    group = Hq // Hkv
    work = T * Hkv
    grid = max(1, min(num_ctas, work))
    _decode_kernel[(grid,)](
        q, k, v, out, work, Hkv, C, d ** -0.5, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), k.stride(2), out.stride(0), out.stride(1), grid, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, BLOCK_N=block_n,
        num_warps=num_warps)
    return out


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
