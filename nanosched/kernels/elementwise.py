"""Row-wise Triton kernels on a bounded persistent grid: RMSNorm with fused residual add,
SiLU-and-multiply, rotary embedding fused with the paged KV-cache write (and, for an FP8 cache,
its quantisation).

Each function has the contract of its twin in `reference.py` (same arguments, writes into the
given outputs). Math runs in fp32; values are rounded to the model dtype where HF rounds them
(the residual sum before the norm, the normalised value before the weight).

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanosched.kernels.common import FP8_MAX, FP8_MIN_SCALE

SILU_BLOCK = 2048  # elements of a silu_mul work item (the row's width when narrower)
ROW_FP8_MAX_BLOCK = 16384  # the widest row an e4m3 producer holds whole (wider: two passes)
PREFETCH = {"rms_norm_add": True, "silu_mul": True, "rope_append": False}


def num_programs(items: int, max_ctas: int | None) -> int:
    """Programs of a launch over `items` work items under the bound `max_ctas` (None: one per
    item)."""
    return items if max_ctas is None else max(1, min(items, max_ctas))


def _prefetch(prefetch: bool | None, kernel: str) -> bool:
    return PREFETCH[kernel] if prefetch is None else prefetch


@triton.jit
def _load_row(x_ptr, r_ptr, s_x, s_r, row, offs, limit, HAS_RES: tl.constexpr):
    row = tl.cast(row, tl.int64)
    mask = offs < limit
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0)
    r = x
    if HAS_RES:
        r = tl.load(r_ptr + row * s_r + offs, mask=mask, other=0.0)
    return x, r


@triton.jit
def _rms_norm_add_kernel(x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, os_ptr, s_x, s_r, s_o, s_ro,
                         n, dim, eps, HAS_RES: tl.constexpr, STORE_RES: tl.constexpr,
                         BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, FP8: tl.constexpr,
                         FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PREFETCH:
        x, r = _load_row(x_ptr, r_ptr, s_x, s_r, pid, offs, dim, HAS_RES)
    for row in range(pid, n, step):
        if PREFETCH:  # the next row's loads are in flight while this row is reduced and stored
            nxt = row + step
            x_next, r_next = _load_row(x_ptr, r_ptr, s_x, s_r, nxt, offs,
                                       tl.where(nxt < n, dim, 0), HAS_RES)
        else:
            x, r = _load_row(x_ptr, r_ptr, s_x, s_r, row, offs, dim, HAS_RES)
        if HAS_RES:
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        row64 = tl.cast(row, tl.int64)
        if STORE_RES:
            tl.store(r_out_ptr + row64 * s_ro + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 0) / dim + eps)
        y = (xf * rstd).to(x.dtype).to(tl.float32) * w
        if FP8:  # the row in the model dtype, quantised with its own scale (the GEMM's input)
            y = y.to(x.dtype).to(tl.float32)
            sc = tl.maximum(tl.max(tl.abs(y), 0) / FP8_MAX, MIN_SCALE)
            tl.store(os_ptr + row64, sc)
            y = y / sc
        tl.store(out_ptr + row64 * s_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
        if PREFETCH:
            x, r = x_next, r_next


def rms_norm_add(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out: torch.Tensor, residual_out: torch.Tensor,
                 out_scale: torch.Tensor | None = None, *, max_ctas: int | None = None,
                 prefetch: bool | None = None) -> None:
    """Triton twin of `reference.rms_norm_add`; a work item is a row. x etc. [n, D]; an e4m3
    `out` gets each row quantised with its scale in `out_scale` [n]; prefetch None:
    `PREFETCH`'s."""
    n, dim = x.shape
    if n == 0:
        return
    has_res = residual is not None
    store_res = has_res or residual_out.data_ptr() != x.data_ptr()
    r = residual if has_res else x
    fp8 = out.dtype == torch.float8_e4m3fn
    _rms_norm_add_kernel[(num_programs(n, max_ctas),)](
        x, r, weight, out, residual_out, out_scale if fp8 else weight, x.stride(0), r.stride(0),
        out.stride(0), residual_out.stride(0), n, dim, eps, HAS_RES=has_res,
        STORE_RES=store_res, BLOCK_D=triton.next_power_of_2(dim),
        PREFETCH=_prefetch(prefetch, "rms_norm_add"), FP8=fp8, FP8_MAX=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE, num_warps=8 if dim >= 4096 else 4)


@triton.jit
def _load_chunk(gu_ptr, s_gu, inter, num_chunks, item, offs0, ok, BLOCK: tl.constexpr):
    row = tl.cast(item // num_chunks, tl.int64)
    offs = (item % num_chunks) * BLOCK + offs0
    mask = offs < tl.where(ok, inter, 0)  # (a scalar mask & a vector one: not interpretable)
    g = tl.load(gu_ptr + row * s_gu + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * s_gu + inter + offs, mask=mask, other=0.0)
    return g, u


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, s_gu, s_o, num_items, inter, num_chunks,
                     BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs0 = tl.arange(0, BLOCK)
    if PREFETCH:
        g, u = _load_chunk(gu_ptr, s_gu, inter, num_chunks, pid, offs0, pid < num_items, BLOCK)
    for item in range(pid, num_items, step):
        if PREFETCH:
            nxt = item + step
            g_next, u_next = _load_chunk(gu_ptr, s_gu, inter, num_chunks, nxt, offs0,
                                         nxt < num_items, BLOCK)
        else:
            g, u = _load_chunk(gu_ptr, s_gu, inter, num_chunks, item, offs0, item < num_items,
                               BLOCK)
        row = tl.cast(item // num_chunks, tl.int64)
        offs = (item % num_chunks) * BLOCK + offs0
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        res = act.to(tl.float32) * u.to(tl.float32)
        tl.store(out_ptr + row * s_o + offs, res.to(out_ptr.dtype.element_ty), mask=offs < inter)
        if PREFETCH:
            g, u = g_next, u_next


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor, *, max_ctas: int | None = None,
             prefetch: bool | None = None) -> None:
    """Triton twin of `reference.silu_mul`; a work item is a `SILU_BLOCK`-wide chunk of a row.
    gate_up [n, 2I] (gate then up), out [n, I]; prefetch None: `PREFETCH`'s."""
    n, inter = out.shape
    if n == 0:
        return
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    chunks = triton.cdiv(inter, block)
    _silu_mul_kernel[(num_programs(n * chunks, max_ctas),)](
        gate_up, out, gate_up.stride(0), out.stride(0), n * chunks, inter, chunks, BLOCK=block,
        PREFETCH=_prefetch(prefetch, "silu_mul"), num_warps=4)


@triton.jit
def _row_chunk(src_ptr, row, offs, inter, SILU: tl.constexpr):
    """One chunk of a row's value in the model dtype, as fp32: SiLU(gate) * up from a
    gate_up row (`SILU`), else the row itself."""
    mask = offs < inter
    g = tl.load(src_ptr + row + offs, mask=mask, other=0.0)
    if SILU:
        u = tl.load(src_ptr + row + inter + offs, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)
    return g.to(tl.float32)


@triton.jit
def _rows_fp8_kernel(src_ptr, out_ptr, os_ptr, s_src, s_o, n, inter, SILU: tl.constexpr,
                     BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, FP8_MAX: tl.constexpr,
                     MIN_SCALE: tl.constexpr):
    """Each row's value (`_row_chunk`) quantised to e4m3 with one scale. A row that fits one
    block is read once and held in registers; a longer one in two passes, one for the amax and
    one that stores (its loads mostly hit L2, which holds the rows in flight)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs0 = tl.arange(0, BLOCK)
    for r in range(pid, n, step):
        row = tl.cast(r, tl.int64)
        if ONE_PASS:
            v = _row_chunk(src_ptr, row * s_src, offs0, inter, SILU)
            sc = tl.maximum(tl.max(tl.abs(v), 0) / FP8_MAX, MIN_SCALE)
            tl.store(os_ptr + row, sc)
            tl.store(out_ptr + row * s_o + offs0, (v / sc).to(out_ptr.dtype.element_ty),
                     mask=offs0 < inter)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for c in range(0, inter, BLOCK):
                v = _row_chunk(src_ptr, row * s_src, c + offs0, inter, SILU)
                amax = tl.maximum(amax, tl.abs(v))
            sc = tl.maximum(tl.max(amax, 0) / FP8_MAX, MIN_SCALE)
            tl.store(os_ptr + row, sc)
            for c in range(0, inter, BLOCK):
                v = _row_chunk(src_ptr, row * s_src, c + offs0, inter, SILU)
                tl.store(out_ptr + row * s_o + c + offs0,
                         (v / sc).to(out_ptr.dtype.element_ty), mask=c + offs0 < inter)


def rows_fp8(src: torch.Tensor, out: torch.Tensor, out_scale: torch.Tensor, *, silu: bool,
             max_ctas: int | None = None) -> None:
    """out [n, K] e4m3 and out_scale [n] fp32: each row of SiLU(gate) * up (`silu`, src the
    [n, 2K] gate_up rows) or of src [n, K] itself, quantised with its own scale. Twin of
    `reference.silu_mul` / `reference.quantize_rows` with an e4m3 out; a work item is a row."""
    n, inter = out.shape
    if n == 0:
        return
    block = triton.next_power_of_2(inter)
    block = block if block <= ROW_FP8_MAX_BLOCK else SILU_BLOCK
    _rows_fp8_kernel[(num_programs(n, max_ctas),)](
        src, out, out_scale, src.stride(0), out.stride(0), n, inter, SILU=silu, BLOCK=block,
        ONE_PASS=block >= inter, FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
        num_warps=16 if block >= 16384 else 8 if block >= 4096 else 4)


@triton.jit
def _load_token(qkv_ptr, pos_ptr, slot_ptr, s_qkv, tok, ok, hq, hk, offs, h_mask, num_q, num_kv,
                HALF: tl.constexpr):
    """A token's position, cache slot, and the two halves of its q [BQ, BH], k and v
    [BKV, BH] heads; when not `ok` token 0's position and slot, and no head."""
    tok = tl.where(ok, tok, 0).to(tl.int64)
    pos = tl.load(pos_ptr + tok)
    slot = tl.load(slot_ptr + tok)
    src = qkv_ptr + tok * s_qkv
    q_off = hq[:, None] * (2 * HALF) + offs[None, :]
    k_off = (num_q + hk)[:, None] * (2 * HALF) + offs[None, :]
    v_off = k_off + num_kv * (2 * HALF)
    qm = (hq < tl.where(ok, num_q, 0))[:, None] & h_mask[None, :]
    km = (hk < tl.where(ok, num_kv, 0))[:, None] & h_mask[None, :]
    q1 = tl.load(src + q_off, mask=qm, other=0.0)
    q2 = tl.load(src + HALF + q_off, mask=qm, other=0.0)
    k1 = tl.load(src + k_off, mask=km, other=0.0)
    k2 = tl.load(src + HALF + k_off, mask=km, other=0.0)
    v1 = tl.load(src + v_off, mask=km, other=0.0)
    v2 = tl.load(src + HALF + v_off, mask=km, other=0.0)
    return pos, slot, q1, q2, k1, k2, v1, v2


@triton.jit
def _rope_append_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr, q_ptr,
                        ks_ptr, vs_ptr, s_qkv, s_cos, s_kslot, s_kh, s_vslot, s_vh, s_qn, s_qh,
                        s_sslot, s_sh, n, num_q, num_kv, HALF: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                        FP8: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                        PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_H)
    h_mask = offs < HALF
    hq = tl.arange(0, BLOCK_Q)
    hk = tl.arange(0, BLOCK_KV)
    q_mask = (hq < num_q)[:, None] & h_mask[None, :]  # [BQ, BH]
    kv_mask = (hk < num_kv)[:, None] & h_mask[None, :]  # [BKV, BH]
    pos, slot, q1, q2, k1, k2, v1, v2 = _load_token(
        qkv_ptr, pos_ptr, slot_ptr, s_qkv, pid, pid < n, hq, hk, offs, h_mask, num_q, num_kv,
        HALF)
    cos = tl.load(cos_ptr + pos * s_cos + offs, mask=h_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * s_cos + offs, mask=h_mask, other=0.0)[None, :]
    for tok in range(pid, n, step):
        nxt = tok + step
        if PREFETCH:  # the next token's loads fly while this one is rotated and stored
            pos_n, slot_n, q1_n, q2_n, k1_n, k2_n, v1_n, v2_n = _load_token(
                qkv_ptr, pos_ptr, slot_ptr, s_qkv, nxt, nxt < n, hq, hk, offs, h_mask, num_q,
                num_kv, HALF)
        dst = q_ptr + tl.cast(tok, tl.int64) * s_qn + hq[:, None] * s_qh + offs[None, :]
        y1 = (q1.to(tl.float32) * cos - q2.to(tl.float32) * sin).to(q1.dtype)
        y2 = (q2.to(tl.float32) * cos + q1.to(tl.float32) * sin).to(q1.dtype)
        tl.store(dst, y1.to(q_ptr.dtype.element_ty), mask=q_mask)
        tl.store(dst + HALF, y2.to(q_ptr.dtype.element_ty), mask=q_mask)
        # k rotated and rounded to the model dtype, as the reference does before quantising
        c1 = (k1.to(tl.float32) * cos - k2.to(tl.float32) * sin).to(k1.dtype).to(tl.float32)
        c2 = (k2.to(tl.float32) * cos + k1.to(tl.float32) * sin).to(k1.dtype).to(tl.float32)
        w1, w2 = v1.to(tl.float32), v2.to(tl.float32)
        if FP8:  # one scale per (token, KV head): the vector's amax lands on e4m3's largest
            k_sc = tl.maximum(tl.maximum(tl.max(tl.abs(c1), 1), tl.max(tl.abs(c2), 1)) / FP8_MAX,
                              MIN_SCALE)  # [BKV]
            v_sc = tl.maximum(tl.maximum(tl.max(tl.abs(w1), 1), tl.max(tl.abs(w2), 1)) / FP8_MAX,
                              MIN_SCALE)
            tl.store(ks_ptr + slot * s_sslot + hk * s_sh, k_sc, mask=hk < num_kv)
            tl.store(vs_ptr + slot * s_sslot + hk * s_sh, v_sc, mask=hk < num_kv)
            c1, c2 = c1 / k_sc[:, None], c2 / k_sc[:, None]
            w1, w2 = w1 / v_sc[:, None], w2 / v_sc[:, None]
        k_dst = k_ptr + slot * s_kslot + hk[:, None] * s_kh + offs[None, :]
        tl.store(k_dst, c1.to(k_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_dst + HALF, c2.to(k_ptr.dtype.element_ty), mask=kv_mask)
        v_dst = v_ptr + slot * s_vslot + hk[:, None] * s_vh + offs[None, :]
        tl.store(v_dst, w1.to(v_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(v_dst + HALF, w2.to(v_ptr.dtype.element_ty), mask=kv_mask)
        if PREFETCH:
            pos, slot, q1, q2, k1, k2, v1, v2 = pos_n, slot_n, q1_n, q2_n, k1_n, k2_n, v1_n, v2_n
        else:
            pos, slot, q1, q2, k1, k2, v1, v2 = _load_token(
                qkv_ptr, pos_ptr, slot_ptr, s_qkv, nxt, nxt < n, hq, hk, offs, h_mask, num_q,
                num_kv, HALF)
        # the next token's rotation (its position has arrived by now; token 0's past the end)
        cos = tl.load(cos_ptr + pos * s_cos + offs, mask=h_mask, other=0.0)[None, :]
        sin = tl.load(sin_ptr + pos * s_cos + offs, mask=h_mask, other=0.0)[None, :]


def rope_append(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                sin_table: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, q_out: torch.Tensor, *, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, max_ctas: int | None = None,
                prefetch: bool | None = None) -> None:
    """Triton twin of `reference.rope_append`; a work item is a token (its q, k and v heads).
    With scales (an FP8 cache) each (token, KV head) vector is quantised with its own scale;
    prefetch None: `PREFETCH`'s."""
    n, num_q, d = q_out.shape
    if n == 0:
        return
    num_kv = k_cache.shape[2]
    k_flat = k_cache.view(-1, num_kv, d)  # [P*S, Hkv, d]
    v_flat = v_cache.view(-1, num_kv, d)
    fp8 = k_scale is not None
    ks = k_scale.view(-1, num_kv) if fp8 else k_flat  # [P*S, Hkv]; unused without FP8
    vs = v_scale.view(-1, num_kv) if fp8 else v_flat
    _rope_append_kernel[(num_programs(n, max_ctas),)](
        qkv, positions, cos_table, sin_table, slot_mapping, k_flat, v_flat, q_out, ks, vs,
        qkv.stride(0), cos_table.stride(0), k_flat.stride(0), k_flat.stride(1),
        v_flat.stride(0), v_flat.stride(1), q_out.stride(0), q_out.stride(1),
        ks.stride(0), ks.stride(1), n, num_q, num_kv,
        HALF=d // 2, BLOCK_H=triton.next_power_of_2(d // 2),
        BLOCK_Q=triton.next_power_of_2(num_q), BLOCK_KV=triton.next_power_of_2(num_kv),
        FP8=fp8, FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
        PREFETCH=_prefetch(prefetch, "rope_append"),
        num_warps=8 if (num_q + 2 * num_kv) * d >= 4096 else 4)
