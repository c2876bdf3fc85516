"""Paged GQA decode attention in Triton: split-K over the context, a bounded persistent grid.

Contract (same as `reference.decode_attention`): q, out [n, Hq, d]; k_cache, v_cache
[P, S, Hkv, d]; block_tables [n, max_pages] int32; context_lens [n] int32. One work item is
(request, KV head, split); a split covers `split_len` consecutive cached tokens. The partial
kernel runs on `max_ctas` programs that loop over the work items (persistent grid), so the caller
bounds the kernel's SM footprint; each item handles the whole GQA group of its KV head with one
`tl.dot`. With more than one split, a second kernel (same CTA bound) merges the partial results
by their log-sum-exp. `max_ctas` and `num_splits` are launch arguments: the profiler sweeps them.
The partial kernel can start each row's splits at a per-row token (HAS_START): cascade_attn
reads each row's suffix past its group's shared prefix that way.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nanosched.errors import ConfigError
from nanosched.kernels.common import PAGED, DecodeConfig, dot_precision, num_sms


@triton.jit
def attend_block(q, k_head, v_head, ks_head, vs_head, page, slot, t_mask, s_mask, d_mask, offs_d,
                 m_i, l_i, acc, scale, s_kp, s_ks, s_vp, s_vs, s_sp, s_ss,
                 FP8: tl.constexpr, DOT_PREC: tl.constexpr, SAFE: tl.constexpr):
    """One online-softmax step over a block of cached tokens (page, slot [BN]; t_mask [BN]
    the tokens that exist, s_mask the scores kept, broadcast to [M, BN]): loads K/V (e4m3 ->
    q's dtype, a token's scale folded into its score and its probability column) and returns
    the updated (m_i, l_i, acc). SAFE: rows may have kept no score yet (their max stays -inf)."""
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_head + page[:, None] * s_kp + slot[:, None] * s_ks + offs_d[None, :],
                mask=kv_mask, other=0.0)  # [BN, BD]
    v = tl.load(v_head + page[:, None] * s_vp + slot[:, None] * s_vs + offs_d[None, :],
                mask=kv_mask, other=0.0)  # [BN, BD]
    if FP8:
        ks = tl.load(ks_head + page * s_sp + slot * s_ss, mask=t_mask, other=0.0)
        vs = tl.load(vs_head + page * s_sp + slot * s_ss, mask=t_mask, other=0.0)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale  # [M, BN]
    if FP8:
        s = s * ks[None, :]
    s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if SAFE:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8:
        pv = (p * vs[None, :]).to(v.dtype)
    else:
        pv = p.to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def finish_block(m_i, l_i, acc):
    """A split's normalised output and log-sum-exp (0 and -inf where no token was kept)."""
    has = l_i > 0
    res = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    return res, lse


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, start_ptr, o_ptr, lse_ptr,
    num_items, num_kv_heads, num_splits, split_len, scale,
    s_qn, s_qh, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_sp, s_ss, s_sh, s_btn,
    s_on, s_oh, s_os, s_ln, s_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, STORE_LSE: tl.constexpr, DOT_PREC: tl.constexpr,
    NUM_STAGES: tl.constexpr, FP8: tl.constexpr, F16_DOTS: tl.constexpr,
    HAS_START: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    for item in tl.range(pid, num_items, tl.num_programs(0), num_stages=1):
        split = item % num_splits
        kvh = (item // num_splits) % num_kv_heads
        req = item // (num_splits * num_kv_heads)
        ctx = tl.load(lens_ptr + req)
        lo = split * split_len
        if HAS_START:  # the row's splits start at its first token not read elsewhere
            lo += tl.load(start_ptr + req)
        hi = tl.minimum(lo + split_len, ctx)
        heads = kvh * GROUP + offs_g  # [BG]
        q = tl.load(q_ptr + req * s_qn + heads[:, None] * s_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BG, BD]
        if F16_DOTS:  # bf16 q, e4m3 cache: e4m3 converts to fp16 in one instruction (to
            q = q.to(tl.float16)  # bf16 through fp32), so the dots run in fp16
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        bt_row = bt_ptr + req * s_btn
        k_head = k_ptr + kvh * s_kh
        v_head = v_ptr + kvh * s_vh
        ks_head = ks_ptr + kvh * s_sh
        vs_head = vs_ptr + kvh * s_sh
        # Each step's page ids are loaded one step ahead, so the K/V addresses depend on a
        # loop-carried value rather than on a load of the same step: the pipeliner then keeps
        # NUM_STAGES - 1 steps of K and V in flight (with the ids loaded in the step that uses
        # them, they cost one of those stages).
        nxt = lo + offs_n
        page_next = tl.load(bt_row + nxt // PAGE, mask=nxt < hi, other=0)
        for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
            tok = start + offs_n  # [BN]
            t_mask = tok < hi
            page = page_next.to(tl.int64)  # page * page stride passes 2^31 past 128K pages
            nxt = tok + BLOCK_N
            page_next = tl.load(bt_row + nxt // PAGE, mask=nxt < hi, other=0)
            slot = tok % PAGE
            m_i, l_i, acc = attend_block(q, k_head, v_head, ks_head, vs_head, page, slot,
                                         t_mask, t_mask[None, :], d_mask, offs_d, m_i, l_i,
                                         acc, scale, s_kp, s_ks, s_vp, s_vs, s_sp, s_ss,
                                         FP8, DOT_PREC, False)
        res, lse = finish_block(m_i, l_i, acc)
        o_off = req * s_on + heads[:, None] * s_oh + split * s_os + offs_d[None, :]
        tl.store(o_ptr + o_off, res.to(o_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])
        if STORE_LSE:
            tl.store(lse_ptr + req * s_ln + heads * s_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_ptr, lse_ptr, part2_ptr, lse2_ptr, out_ptr, num_items, num_heads, num_splits,
    num_splits2, s_pn, s_ph, s_ps, s_ln, s_lh, s2_pn, s2_ph, s2_ps, s2_ln, s2_lh, s_on, s_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr, TWO: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    head_blocks = tl.cdiv(num_heads, BLOCK_H)
    for item in range(pid, num_items, tl.num_programs(0)):
        req = item // head_blocks
        heads = (item % head_blocks) * BLOCK_H + offs_h  # [BH]
        h_mask = heads < num_heads
        hs_mask = h_mask[:, None] & s_mask[None, :]
        lse = tl.load(lse_ptr + req * s_ln + heads[:, None] * s_lh + offs_s[None, :],
                      mask=hs_mask, other=float("-inf"))  # [BH, BS]
        part = tl.load(part_ptr + req * s_pn + heads[:, None, None] * s_ph
                       + offs_s[None, :, None] * s_ps + offs_d[None, None, :],
                       mask=hs_mask[:, :, None] & d_mask[None, None, :], other=0.0)
        if TWO:  # slots num_splits.. of the row come from the second set
            offs_s2 = offs_s - num_splits
            hs2_mask = h_mask[:, None] & ((offs_s2 >= 0) & (offs_s2 < num_splits2))[None, :]
            lse2 = tl.load(lse2_ptr + req * s2_ln + heads[:, None] * s2_lh + offs_s2[None, :],
                           mask=hs2_mask, other=float("-inf"))
            part2 = tl.load(part2_ptr + req * s2_pn + heads[:, None, None] * s2_ph
                            + offs_s2[None, :, None] * s2_ps + offs_d[None, None, :],
                            mask=hs2_mask[:, :, None] & d_mask[None, None, :], other=0.0)
            lse = tl.where(hs2_mask, lse2, lse)
            part = tl.where(hs2_mask[:, :, None], part2, part)
        top = tl.max(lse, 1)
        top = tl.where(top == float("-inf"), 0.0, top)  # an empty context: every split empty
        weight = tl.exp(lse - top[:, None])
        total = tl.sum(weight, 1)
        weight = weight / tl.where(total > 0, total, 1.0)[:, None]  # all zero: the output is 0
        res = tl.sum(part * weight[:, :, None], 1)  # [BH, BD]
        tl.store(out_ptr + req * s_on + heads[:, None] * s_oh + offs_d[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


MERGE_TILE = 4096  # fp32 partial elements a merge item reads (32 a thread on 4 warps)


def plan_splits(num_requests: int, num_kv_heads: int, max_context_len: int, max_ctas: int,
                num_splits: int | None = None, block: int = PAGED.block_n) -> tuple[int, int]:
    """(num_splits, split_len): enough work items (request x KV head x split) for `max_ctas`
    programs, each a whole number of `block`-token steps."""
    max_blocks = max(1, math.ceil(max_context_len / block))
    if num_splits is None:
        num_splits = math.ceil(2 * max_ctas / max(1, num_requests * num_kv_heads))
    num_splits = max(1, min(num_splits, max_blocks))
    split_len = math.ceil(max_blocks / num_splits) * block
    return math.ceil(max_context_len / split_len), split_len


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     max_context_len: int, scale: float, out: torch.Tensor,
                     max_ctas: int | None = None, num_splits: int | None = None,
                     config: DecodeConfig = PAGED, *, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> None:
    """Triton paged decode attention; see the module docstring for shapes and launch args."""
    n, num_q, d = q.shape
    if n == 0:
        return
    num_kv, page = k_cache.shape[2], k_cache.shape[1]
    if max_ctas is None:
        max_ctas = config.ctas_per_sm * num_sms(q.device)
    fp8 = k_scale is not None
    block_n = config.block_for(fp8)
    splits, split_len = plan_splits(n, num_kv, max_context_len, max_ctas, num_splits, block_n)
    group = num_q // num_kv
    num_items = n * num_kv * splits
    if splits == 1:
        part, lse = out, out  # write straight to out; lse is never touched
        s_part = (out.stride(0), out.stride(1), 0)
    else:
        part = torch.empty((n, num_q, splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((n, num_q, splits), dtype=torch.float32, device=q.device)
        s_part = part.stride()[:3]
    block_d = triton.next_power_of_2(d)
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)  # unused without FP8
    if fp8 and k_scale.stride() != v_scale.stride():
        raise ValueError("k_scale and v_scale must share a layout")
    _decode_partial_kernel[(min(max_ctas, num_items),)](
        q, k_cache, v_cache, ks, vs, block_tables, context_lens, context_lens, part, lse,
        num_items, num_kv, splits, split_len, scale,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        *ks.stride()[:3], block_tables.stride(0), *s_part,
        lse.stride(0) if splits > 1 else 0, lse.stride(1) if splits > 1 else 0,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_D=block_d, BLOCK_N=block_n, PAGE=page, STORE_LSE=splits > 1,
        DOT_PREC=dot_precision(q.dtype), NUM_STAGES=config.num_stages, FP8=fp8,
        F16_DOTS=fp8 and q.dtype == torch.bfloat16, HAS_START=False,
        num_warps=config.num_warps)
    if splits > 1:
        merge_splits(part, lse, out, max_ctas)


def merge_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, max_ctas: int,
                 more: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """out [n, Hq, d] = the split partials part [n, Hq, S, d] (fp32, each normalised) weighted
    by their log-sum-exp lse [n, Hq, S], on at most `max_ctas` programs; `more` = (part2, lse2)
    adds a second set of splits of the same rows (another kernel's), as if appended. A work
    item merges MERGE_TILE elements' worth of a row's heads at once: one (row, head) an item
    left each program a long chain of small dependent loads (32,000 for 1,000 rows of 32)."""
    n, num_q, splits, d = part.shape
    part2, lse2 = more if more is not None else (part, lse)
    splits2 = part2.shape[2] if more is not None else 0
    if more is not None and (part2.shape[:2] != (n, num_q) or part2.shape[3] != d
                             or lse2.shape != part2.shape[:3]):
        raise ConfigError(f"merge_splits: the second set's part {tuple(part2.shape)} and lse "
                          f"{tuple(lse2.shape)} must be [{n}, {num_q}, S2, {d}] and "
                          f"[{n}, {num_q}, S2]")
    block_s, block_d = triton.next_power_of_2(splits + splits2), triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(num_q), MERGE_TILE // (block_s * block_d)))
    merge_items = n * triton.cdiv(num_q, block_h)
    _decode_merge_kernel[(min(max_ctas, merge_items),)](
        part, lse, part2, lse2, out, merge_items, num_q, splits, splits2,
        *part.stride()[:3], lse.stride(0), lse.stride(1), *part2.stride()[:3], lse2.stride(0),
        lse2.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=block_s, BLOCK_H=block_h, TWO=more is not None,
        num_warps=4)
