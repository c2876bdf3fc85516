"""Cascade decode attention in Triton: a group's shared prefix pages are read once for all its rows.

Computes what `reference.decode_attention` computes over each row's whole context. The rows come
in contiguous groups (`CascadeGroups`): group g holds rows starts[g] .. starts[g+1]-1 (the groups
partition the rows) and its rows' block tables begin with the same prefix_lens[g] / S pages. Rows
that share nothing sit in a group of prefix 0. Three launches, no host sync: (1) the prefix kernel,
one work item per (group, KV head, prefix split, tile of rows), M = the tile's rows x the GQA
group's query heads, streams the prefix once per tile through `tl.dot` (a tile's K/V items are
adjacent, so tiles of one group meet in L2), writes partials + LSE and each row's suffix start;
(2) decode_attn's partial kernel from that start to the row's context, or decode_attn_bulk's
kernel over each row's block table shifted past its prefix; (3) decode_attn's `merge_splits`
over the prefix and suffix partials by log-sum-exp. bf16/fp16/fp32, and the e4m3
cache with its per-(token, KV head) scales, as decode_attention takes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from nanosched.errors import ConfigError
from nanosched.kernels.common import (
    PIPELINED,
    CascadeGroups,
    DecodeConfig,
    dot_precision,
    num_sms,
)
from nanosched.kernels.decode_attn import (
    _decode_partial_kernel,
    attend_block,
    finish_block,
    merge_splits,
    plan_splits,
)


@dataclass(frozen=True)
class PrefixConfig:
    """Launch shape of the prefix kernel: M rows of a tile (tile rows x GQA heads, a power of
    two >= 16), tokens per loop step, pipelining depth, warps."""

    block_m: int = 64
    block_n: int = 64
    num_stages: int = 2
    num_warps: int = 4


PREFIX = PrefixConfig()
SUFFIX_IMPLS = ("triton", "cuda_bulk")  # what reads the rows' own tokens
BULK_SPLITS = 2  # splits of each row's suffix with cuda_bulk (its partials need two or more)


@triton.jit
def _prefix_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, starts_ptr, plens_ptr, o_ptr, lse_ptr,
    row_start_ptr, num_items, num_kv_heads, num_splits, num_tiles, split_len, scale,
    s_qn, s_qh, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_sp, s_ss, s_sh, s_btn,
    s_on, s_oh, s_os, s_ln, s_lh,
    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DOT_PREC: tl.constexpr,
    NUM_STAGES: tl.constexpr, FP8: tl.constexpr, F16_DOTS: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)  # m = tile row * GROUP + query head within the GQA group
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    for item in tl.range(pid, num_items, tl.num_programs(0), num_stages=1):
        tile = item % num_tiles  # innermost: a group's tiles read the same K/V side by side
        split = (item // num_tiles) % num_splits
        kvh = (item // (num_tiles * num_splits)) % num_kv_heads
        grp = item // (num_tiles * num_splits * num_kv_heads)
        first = tl.load(starts_ptr + grp)
        end = tl.load(starts_ptr + grp + 1)
        r_lo = first + tile * ROWS
        if r_lo < end:
            rows = r_lo + offs_m // GROUP  # [BM]
            heads = kvh * GROUP + offs_m % GROUP
            m_mask = (offs_m < ROWS * GROUP) & (rows < end)
            plen = tl.load(plens_ptr + grp)
            ctx = tl.load(lens_ptr + rows, mask=m_mask, other=0)  # a row reads only its context
            if (kvh == 0) & (split == 0):  # where the row's own tokens start (suffix kernel)
                tl.store(row_start_ptr + rows, tl.minimum(ctx, plen),
                         mask=m_mask & (offs_m % GROUP == 0))
            lo = split * split_len
            hi = tl.minimum(lo + split_len, plen)
            q = tl.load(q_ptr + rows[:, None] * s_qn + heads[:, None] * s_qh + offs_d[None, :],
                        mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BM, BD]
            if F16_DOTS:  # bf16 q, e4m3 cache: the dots run in fp16, as in decode_attn
                q = q.to(tl.float16)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            bt_row = bt_ptr + first.to(tl.int64) * s_btn  # the group's first row holds the prefix
            k_head = k_ptr + kvh * s_kh
            v_head = v_ptr + kvh * s_vh
            ks_head = ks_ptr + kvh * s_sh
            vs_head = vs_ptr + kvh * s_sh
            # page ids one step ahead, as in decode_attn's partial kernel: K/V addresses then
            # depend on a loop-carried value, so the pipeliner keeps NUM_STAGES - 1 steps of
            # K/V in flight instead of spending a stage on the ids
            nxt = lo + offs_n
            page_next = tl.load(bt_row + nxt // PAGE, mask=nxt < hi, other=0)
            for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
                tok = start + offs_n  # [BN]
                t_mask = tok < hi
                page = page_next.to(tl.int64)
                nxt = tok + BLOCK_N
                page_next = tl.load(bt_row + nxt // PAGE, mask=nxt < hi, other=0)
                slot = tok % PAGE
                keep = t_mask[None, :] & (tok[None, :] < ctx[:, None])  # a row's own context
                m_i, l_i, acc = attend_block(q, k_head, v_head, ks_head, vs_head, page, slot,
                                             t_mask, keep, d_mask, offs_d, m_i, l_i, acc,
                                             scale, s_kp, s_ks, s_vp, s_vs, s_sp, s_ss, FP8,
                                             DOT_PREC, True)
            res, lse = finish_block(m_i, l_i, acc)  # a row past its context: 0 and -inf
            tl.store(o_ptr + rows[:, None] * s_on + heads[:, None] * s_oh + split * s_os
                     + offs_d[None, :], res, mask=m_mask[:, None] & d_mask[None, :])
            tl.store(lse_ptr + rows * s_ln + heads * s_lh + split, lse, mask=m_mask)


def check_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor,
               groups: CascadeGroups) -> None:
    """Refuse, naming the input, shapes the kernels would misread (host shapes only)."""
    n, num_q, d = q.shape
    num_kv, page = k_cache.shape[2], k_cache.shape[1]
    if out.shape != q.shape:
        raise ConfigError(f"cascade attention: out {tuple(out.shape)} != q {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[3] != d:
        raise ConfigError(f"cascade attention: k_cache {tuple(k_cache.shape)} and v_cache "
                          f"{tuple(v_cache.shape)} must both be [P, S, Hkv, {d}]")
    if num_q % num_kv:
        raise ConfigError(f"cascade attention: q's {num_q} heads are not a multiple of the "
                          f"cache's {num_kv} KV heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != n or context_lens.shape != (n,):
        raise ConfigError(f"cascade attention: block_tables {tuple(block_tables.shape)} and "
                          f"context_lens {tuple(context_lens.shape)} must be [{n}, pages], [{n}]")
    g = groups.num_groups
    if groups.starts.shape != (g + 1,) or groups.starts.dtype != torch.int32 \
            or groups.prefix_lens.dtype != torch.int32:
        raise ConfigError(f"cascade groups: starts {tuple(groups.starts.shape)} "
                          f"{groups.starts.dtype} must be [{g + 1}] int32 beside prefix_lens "
                          f"[{g}] int32")
    if groups.max_prefix_len % page or groups.max_prefix_len < 0:
        raise ConfigError(f"cascade groups: max_prefix_len {groups.max_prefix_len} is not a "
                          f"multiple of the page size {page}")
    if groups.max_prefix_len > block_tables.shape[1] * page:
        raise ConfigError(f"cascade groups: max_prefix_len {groups.max_prefix_len} exceeds the "
                          f"block tables' {block_tables.shape[1]} pages of {page}")


@dataclass(frozen=True)
class CascadePlan:
    """Host-side launch sizes: the prefix tile (M, rows, tiles per group), prefix splits and
    their tokens, suffix splits and their tokens; the partials hold p_splits + s_splits slots."""

    block_m: int
    rows_per_tile: int
    num_tiles: int
    p_splits: int
    p_len: int
    s_splits: int
    s_len: int


def cascade_plan(groups: CascadeGroups, num_rows: int, num_kv: int, group: int,
                 max_suffix_len: int, max_ctas: int, prefix_splits: int | None = None,
                 suffix_splits: int | None = None, suffix_block: int = PIPELINED.block_n,
                 prefix: PrefixConfig = PREFIX) -> CascadePlan:
    """The launch sizes `cascade_decode_attention` uses (decode_attn.plan_splits for both)."""
    block_m = max(prefix.block_m, 16, triton.next_power_of_2(group))
    rows_per_tile = block_m // group
    num_tiles = max(1, math.ceil(groups.max_rows / rows_per_tile))
    p_splits, p_len = plan_splits(groups.num_groups * num_tiles, num_kv,
                                  max(groups.max_prefix_len, 1), max_ctas, prefix_splits,
                                  prefix.block_n)
    s_splits, s_len = plan_splits(num_rows, num_kv, max(max_suffix_len, 1), max_ctas,
                                  suffix_splits, suffix_block)
    return CascadePlan(block_m, rows_per_tile, num_tiles, p_splits, p_len, s_splits, s_len)


@dataclass(frozen=True)
class CascadeLaunches:
    """One call's three launches over buffers already allocated: `prefix` (partials, LSE and
    each row's suffix start), `suffix` (from that start; needs `prefix` run once before it on
    the same data), `merge`. Calling it runs the three in order. Apart they let a benchmark
    time each launch (bench/kernels/kernels_cascade_attn.py --parts)."""

    prefix: Callable[[], None]
    suffix: Callable[[], None]
    merge: Callable[[], None]
    plan: CascadePlan

    def __call__(self) -> None:
        self.prefix()
        self.suffix()
        self.merge()


def cascade_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, context_lens: torch.Tensor,
                             max_context_len: int, scale: float, out: torch.Tensor,
                             groups: CascadeGroups, **kwargs: Any) -> None:
    """out [n, Hq, d] = decode attention of q over each row's whole context, the prefix of
    each group read once per row tile. Arguments as decode_attn.decode_attention, plus `groups`;
    keyword arguments as `cascade_launches`."""
    launches = cascade_launches(q, k_cache, v_cache, block_tables, context_lens,
                                max_context_len, scale, out, groups, **kwargs)
    if launches is not None:
        launches()


def cascade_launches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     max_context_len: int, scale: float, out: torch.Tensor,
                     groups: CascadeGroups, *, max_suffix_len: int | None = None,
                     max_ctas: int | None = None, prefix_splits: int | None = None,
                     suffix_splits: int | None = None, config: DecodeConfig = PIPELINED,
                     prefix: PrefixConfig = PREFIX, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None,
                     suffix_impl: str = "triton") -> CascadeLaunches | None:
    """The launches of `cascade_decode_attention` (None for no rows), checked and planned, their
    partials allocated. `max_suffix_len` bounds any row's tokens past its prefix (default
    max_context_len); `config` is the suffix kernel's DecodeConfig, `prefix` the prefix
    kernel's (`suffix_splits` and `config` are the Triton suffix's). `suffix_impl` "cuda_bulk"
    reads the suffixes with decode_attn_bulk's kernel
    instead (its unmerged partials, in BULK_SPLITS splits, over each row's block table shifted
    past its prefix), where it runs (bf16/fp16 q, 16-token pages; ConfigError says why not)."""
    if suffix_impl not in SUFFIX_IMPLS:
        raise ConfigError(f"cascade attention: suffix_impl {suffix_impl!r} is not one of "
                          f"{SUFFIX_IMPLS}")
    check_args(q, k_cache, v_cache, block_tables, context_lens, out, groups)
    n, num_q, d = q.shape
    if n == 0:
        return None
    num_kv, page = k_cache.shape[2], k_cache.shape[1]
    group = num_q // num_kv
    fp8 = k_scale is not None
    if fp8 and (v_scale is None or k_scale.stride() != v_scale.stride()):
        raise ConfigError("cascade attention: k_scale and v_scale must both be given and share "
                          "a layout")
    if max_ctas is None:
        max_ctas = config.ctas_per_sm * num_sms(q.device)
    suffix_len = max_context_len if max_suffix_len is None else max_suffix_len
    plan = cascade_plan(groups, n, num_kv, group, suffix_len, max_ctas, prefix_splits,
                        suffix_splits, config.block_for(fp8), prefix)
    bulk = suffix_impl == "cuda_bulk"
    if bulk:
        from nanosched.kernels import decode_attn_bulk

        why = decode_attn_bulk.missing_dependency() or decode_attn_bulk.unsupported(
            q, k_cache, v_cache, k_scale, v_scale)
        if why:
            raise ConfigError(f"cascade attention: the cuda_bulk suffix cannot run: {why}")
        per = decode_attn_bulk.partial_pages(suffix_len, BULK_SPLITS)
        plan = replace(plan, s_splits=BULK_SPLITS, s_len=per * page)
    slots = plan.p_splits + (0 if bulk else plan.s_splits)
    part = torch.empty((n, num_q, slots, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((n, num_q, slots), dtype=torch.float32, device=q.device)
    row_start = torch.empty((n,), dtype=torch.int32, device=q.device)
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)  # unused without FP8
    strides = (q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
               *ks.stride()[:3], block_tables.stride(0), *part.stride()[:3], *lse.stride()[:2])
    common = dict(HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), PAGE=page,
                  DOT_PREC=dot_precision(q.dtype), FP8=fp8,
                  F16_DOTS=fp8 and q.dtype == torch.bfloat16)
    p_items = groups.num_groups * num_kv * plan.p_splits * plan.num_tiles

    def run_prefix() -> None:
        _prefix_kernel[(max(1, min(max_ctas, p_items)),)](
            q, k_cache, v_cache, ks, vs, block_tables, context_lens, groups.starts,
            groups.prefix_lens, part, lse, row_start, p_items, num_kv, plan.p_splits,
            plan.num_tiles, plan.p_len, scale, *strides, GROUP=group, ROWS=plan.rows_per_tile,
            BLOCK_M=plan.block_m,
            BLOCK_N=prefix.block_n, NUM_STAGES=prefix.num_stages, num_warps=prefix.num_warps,
            **common)

    if bulk:  # the suffix partials in buffers of the bulk kernel's layout, merged as a 2nd set
        s_part = torch.empty((n, num_q, BULK_SPLITS, d), dtype=torch.float32, device=q.device)
        s_lse = torch.empty((n, num_q, BULK_SPLITS), dtype=torch.float32, device=q.device)
        width = block_tables.shape[1]
        cols = torch.arange(width, device=q.device)[None, :]

        def run_suffix() -> None:
            # row i's suffix: its block table from page row_start / S on (the prefix is whole
            # pages; a row inside its prefix has no suffix tokens), its context less row_start
            shifted = (cols + (row_start // page)[:, None]).clamp_(max=width - 1)
            decode_attn_bulk.decode_partials(
                q, k_cache, v_cache, block_tables.gather(1, shifted), context_lens - row_start,
                suffix_len, scale, s_part, s_lse, k_scale=k_scale, v_scale=v_scale)

        return CascadeLaunches(
            run_prefix, run_suffix,
            lambda: merge_splits(part, lse, out, max_ctas, more=(s_part, s_lse)), plan)

    s_items = n * num_kv * plan.s_splits
    s_part, s_lse = part[:, :, plan.p_splits:], lse[:, :, plan.p_splits:]  # the suffix's slots

    def run_suffix() -> None:
        _decode_partial_kernel[(min(max_ctas, s_items),)](
            q, k_cache, v_cache, ks, vs, block_tables, context_lens, row_start, s_part, s_lse,
            s_items, num_kv, plan.s_splits, plan.s_len, scale, *strides,
            GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
            BLOCK_N=config.block_for(fp8),
            STORE_LSE=True, NUM_STAGES=config.num_stages, HAS_START=True,
            num_warps=config.num_warps, **common)

    return CascadeLaunches(run_prefix, run_suffix,
                           lambda: merge_splits(part, lse, out, max_ctas), plan)
