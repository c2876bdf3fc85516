"""Row-wise Triton kernels: RMSNorm with fused residual add, SiLU-and-multiply, rotary
embedding fused with the paged KV-cache write (and, for an FP8 cache, its quantisation).

Each function has the contract of its twin in `reference.py` (same arguments, writes into the
given outputs). Math runs in fp32; values are rounded to the model dtype where HF rounds them
(the residual sum before the norm, the normalised value before the weight).

Imports triton at module level: import this module only through `nanosched.kernels.dispatch`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanosched.kernels.common import FP8_MAX, FP8_MIN_SCALE


@triton.jit
def _rms_norm_add_kernel(x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, s_x, s_r, s_o, s_ro, dim, eps,
                         HAS_RES: tl.constexpr, STORE_RES: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * s_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    if STORE_RES:
        tl.store(r_out_ptr + row * s_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / dim + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * s_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_add(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out: torch.Tensor, residual_out: torch.Tensor) -> None:
    """Triton twin of `reference.rms_norm_add`: one program per row. x etc. [n, D]."""
    n, dim = x.shape
    if n == 0:
        return
    has_res = residual is not None
    store_res = has_res or residual_out.data_ptr() != x.data_ptr()
    r = residual if has_res else x
    _rms_norm_add_kernel[(n,)](
        x, r, weight, out, residual_out, x.stride(0), r.stride(0), out.stride(0),
        residual_out.stride(0), dim, eps, HAS_RES=has_res, STORE_RES=store_res,
        BLOCK_D=triton.next_power_of_2(dim), num_warps=8 if dim >= 4096 else 4)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, s_gu, s_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gu_ptr + row * s_gu + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * s_gu + inter + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    res = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * s_o + offs, res.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """Triton twin of `reference.silu_mul`. gate_up [n, 2I] (gate then up), out [n, I]."""
    n, inter = out.shape
    if n == 0:
        return
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)


@triton.jit
def _rope_append_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr, q_ptr,
                        ks_ptr, vs_ptr, s_qkv, s_cos, s_kslot, s_kh, s_vslot, s_vh, s_qn, s_qh,
                        s_sslot, s_sh, num_q, num_kv, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                        FP8: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < HALF
    pos = tl.load(pos_ptr + tok)
    cos = tl.load(cos_ptr + pos * s_cos + offs, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + pos * s_cos + offs, mask=mask, other=0.0)
    src = qkv_ptr + tok * s_qkv + head * (2 * HALF)
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    y1 = (x1.to(tl.float32) * cos - x2.to(tl.float32) * sin).to(x1.dtype)
    y2 = (x2.to(tl.float32) * cos + x1.to(tl.float32) * sin).to(x1.dtype)
    if head < num_q:
        dst = q_ptr + tok * s_qn + head * s_qh
        tl.store(dst + offs, y1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + offs, y2.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        kvh = head - num_q
        slot = tl.load(slot_ptr + tok)
        v_src = src + num_kv * (2 * HALF)
        v1 = tl.load(v_src + offs, mask=mask, other=0.0)
        v2 = tl.load(v_src + HALF + offs, mask=mask, other=0.0)
        k1, k2 = y1.to(tl.float32), y2.to(tl.float32)
        w1, w2 = v1.to(tl.float32), v2.to(tl.float32)
        if FP8:  # one scale per (token, KV head): the vector's amax lands on e4m3's largest
            k_sc = tl.maximum(tl.maximum(tl.max(tl.abs(k1), 0), tl.max(tl.abs(k2), 0)) / FP8_MAX,
                              MIN_SCALE)
            v_sc = tl.maximum(tl.maximum(tl.max(tl.abs(w1), 0), tl.max(tl.abs(w2), 0)) / FP8_MAX,
                              MIN_SCALE)
            tl.store(ks_ptr + slot * s_sslot + kvh * s_sh, k_sc)
            tl.store(vs_ptr + slot * s_sslot + kvh * s_sh, v_sc)
            k1, k2, w1, w2 = k1 / k_sc, k2 / k_sc, w1 / v_sc, w2 / v_sc
        k_dst = k_ptr + slot * s_kslot + kvh * s_kh
        tl.store(k_dst + offs, k1.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(k_dst + HALF + offs, k2.to(k_ptr.dtype.element_ty), mask=mask)
        v_dst = v_ptr + slot * s_vslot + kvh * s_vh
        tl.store(v_dst + offs, w1.to(v_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + HALF + offs, w2.to(v_ptr.dtype.element_ty), mask=mask)


def rope_append(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                sin_table: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, q_out: torch.Tensor, *, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> None:
    """Triton twin of `reference.rope_append`: one program per (token, q or kv head); with
    scales (an FP8 cache) each (token, KV head) vector is quantised with its own scale."""
    n, num_q, d = q_out.shape
    if n == 0:
        return
    num_kv = k_cache.shape[2]
    k_flat = k_cache.view(-1, num_kv, d)  # [P*S, Hkv, d]
    v_flat = v_cache.view(-1, num_kv, d)
    fp8 = k_scale is not None
    ks = k_scale.view(-1, num_kv) if fp8 else k_flat  # [P*S, Hkv]; unused without FP8
    vs = v_scale.view(-1, num_kv) if fp8 else v_flat
    _rope_append_kernel[(n, num_q + num_kv)](
        qkv, positions, cos_table, sin_table, slot_mapping, k_flat, v_flat, q_out, ks, vs,
        qkv.stride(0), cos_table.stride(0), k_flat.stride(0), k_flat.stride(1),
        v_flat.stride(0), v_flat.stride(1), q_out.stride(0), q_out.stride(1),
        ks.stride(0), ks.stride(1), num_q, num_kv,
        HALF=d // 2, BLOCK_H=triton.next_power_of_2(d // 2), FP8=fp8, FP8_MAX=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE, num_warps=1)
