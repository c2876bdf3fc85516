"""Paged, variable-length, causal prefill attention in Triton (flash-attention online softmax, GQA).

Contract (same as `reference.prefill_attention`): q, out [n, Hq, d] are the prefill rows; k_cache,
v_cache [P, S, Hkv, d] already hold this chunk's own K/V (rope_append wrote them); block_tables
[num_segments, max_pages] int32. Segment i covers q rows start_i .. start_i + len_i - 1 of one
request at positions first_pos_i.., and attends to that request's cached tokens 0 .. its own
position (causal, lower-right aligned). K/V are read page by page from the cache: no gather copy.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanosched.errors import ConfigError
from nanosched.kernels.common import PrefillSegments, Segment, dot_precision

LOG2E = 1.4426950408889634


@triton.jit
def _tile_pages(bt_row, kv, kv_end, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                MASKED: tl.constexpr):
    """Page ids of the K/V tile [kv, kv + BLOCK_N), int64 (page * stride passes 2^31); MASKED:
    0 past kv_end (unmasked, every key of the tile must lie before it)."""
    keys = kv + tl.arange(0, BLOCK_N)
    if MASKED:
        return tl.load(bt_row + keys // PAGE, mask=keys < kv_end, other=0).to(tl.int64)
    return tl.load(bt_row + keys // PAGE).to(tl.int64)


@triton.jit
def _step_pages(bt_row, kv, kv_end, page_next, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                MASKED: tl.constexpr, PAGES_AHEAD: tl.constexpr):
    """(this tile's page ids, the next tile's): with PAGES_AHEAD the ids loaded a step earlier
    and the next ones loaded now (masked: the next tile may pass kv_end), else this tile's
    loaded now, masked as the tile is (`page_next` passed through)."""
    if PAGES_AHEAD:
        return page_next, _tile_pages(bt_row, kv + BLOCK_N, kv_end, BLOCK_N, PAGE, True)
    return _tile_pages(bt_row, kv, kv_end, BLOCK_N, PAGE, MASKED), page_next


@triton.jit
def _first_pages(bt_row, kv, kv_end, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                 PAGES_AHEAD: tl.constexpr):
    """The page ids a loop from tile `kv` starts with: loaded with PAGES_AHEAD, else unused."""
    if PAGES_AHEAD:
        return _tile_pages(bt_row, kv, kv_end, BLOCK_N, PAGE, True)
    return tl.zeros([BLOCK_N], tl.int64)


@triton.jit
def _attend(acc, m_i, l_i, q, q_pos, kv, kv_end, page, k_ptr, v_ptr, ks_ptr, vs_ptr, kvh,
            scale_log2, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_sp, s_ss, s_sh,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
            PAGE: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
            FP8: tl.constexpr):
    """One K/V tile [kv, kv + BLOCK_N), its page ids `page` [BN] given, folded into the online
    softmax of the rows."""
    keys = kv + tl.arange(0, BLOCK_N)  # [BN] positions in the request
    offs_d = tl.arange(0, BLOCK_D)
    if MASKED or HEAD_DIM != BLOCK_D:
        k_ok = keys < kv_end
        kv_mask = k_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        slot = keys % PAGE
        k = tl.load(k_ptr + page[:, None] * s_kp + slot[:, None] * s_ks + kvh * s_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0)  # [BN, BD]
        v = tl.load(v_ptr + page[:, None] * s_vp + slot[:, None] * s_vs + kvh * s_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
    else:  # every key of the tile is seen by every row: no mask
        slot = keys % PAGE
        k = tl.load(k_ptr + page[:, None] * s_kp + slot[:, None] * s_ks + kvh * s_kh
                    + offs_d[None, :])
        v = tl.load(v_ptr + page[:, None] * s_vp + slot[:, None] * s_vs + kvh * s_vh
                    + offs_d[None, :])
    if FP8:  # e4m3 -> q's dtype (fp16 for bf16); a key's scale scales its logits, a value's p
        s_off = page * s_sp + slot * s_ss + kvh * s_sh
        ks = tl.load(ks_ptr + s_off, mask=keys < kv_end, other=0.0)
        vs = tl.load(vs_ptr + s_off, mask=keys < kv_end, other=0.0)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [BM, BN], log2 units
    if FP8:
        s = s * ks[None, :]
    if MASKED:
        s = tl.where(keys[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:  # a row may see none of this tile: keep exp2 away from (-inf) - (-inf)
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8:
        p = p * vs[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, start_ptr, len_ptr, pos_ptr, o_ptr, scale_log2,
    num_segments, s_qn, s_qh, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_sp, s_ss, s_sh, s_bt, s_on,
    s_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, BLOCK_S: tl.constexpr,
    DOT_PREC: tl.constexpr, FP8: tl.constexpr, F16_DOTS: tl.constexpr,
    PAGES_AHEAD: tl.constexpr,
):
    # program -> (segment, m-tile): segments' m-tiles laid end to end, counted on the device
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    lens = tl.load(len_ptr + offs_s, mask=offs_s < num_segments, other=0)
    tiles = (lens * GROUP + BLOCK_M - 1) // BLOCK_M  # [BS] m-tiles of each segment
    ends = tl.cumsum(tiles, 0)
    seg = tl.sum((ends <= tile).to(tl.int32), 0)
    if seg >= num_segments:
        return  # past the last segment's tiles (the grid is a bound)
    pick = offs_s == seg
    m_tile = tl.sum(tl.where(pick, ends, 0), 0) - 1 - tile  # last tile first: the heaviest
    length = tl.sum(tl.where(pick, lens, 0), 0)
    start = tl.load(start_ptr + seg)
    first = tl.load(pos_ptr + seg)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] flattened (token, head in group)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = rows < length * GROUP
    offs_d = tl.arange(0, BLOCK_D)
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + (start + tok)[:, None] * s_qn + head[:, None] * s_qh + offs_d[None, :],
                mask=io_mask, other=0.0)  # [BM, BD]
    if F16_DOTS:  # bf16 q, e4m3 cache: e4m3 converts to fp16 in one instruction (to
        q = q.to(tl.float16)  # bf16 through fp32), so the dots run in fp16
    q_pos = first + tok  # [BM]
    tok_lo = (m_tile * BLOCK_M) // GROUP
    tok_hi = tl.minimum((m_tile * BLOCK_M + BLOCK_M - 1) // GROUP, length - 1)
    full_end = (first + tok_lo + 1) // BLOCK_N * BLOCK_N  # whole tiles every row sees
    kv_end = first + tok_hi + 1  # past the last row's position
    bt_row = bt_ptr + seg.to(tl.int64) * s_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # PAGES_AHEAD: each tile's page ids are loaded one tile ahead, so the K/V addresses depend
    # on a loop-carried value rather than on a load of the same step and the pipeliner keeps
    # num_stages - 1 tiles of K/V in flight (as decode_attn's partial kernel)
    page_next = _first_pages(bt_row, 0, kv_end, BLOCK_N, PAGE, PAGES_AHEAD)
    for kv in range(0, full_end, BLOCK_N):
        page, page_next = _step_pages(bt_row, kv, kv_end, page_next, BLOCK_N, PAGE,
                                      HEAD_DIM != BLOCK_D, PAGES_AHEAD)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, q_pos, kv, kv_end, page, k_ptr, v_ptr,
                                ks_ptr, vs_ptr, kvh, scale_log2, s_kp, s_ks, s_kh, s_vp, s_vs,
                                s_vh, s_sp, s_ss, s_sh, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, False,
                                DOT_PREC, FP8)
    page_next = _first_pages(bt_row, full_end, kv_end, BLOCK_N, PAGE, PAGES_AHEAD)
    for kv in range(full_end, kv_end, BLOCK_N):
        page, page_next = _step_pages(bt_row, kv, kv_end, page_next, BLOCK_N, PAGE, True,
                                      PAGES_AHEAD)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, q_pos, kv, kv_end, page, k_ptr, v_ptr,
                                ks_ptr, vs_ptr, kvh, scale_log2, s_kp, s_ks, s_kh, s_vp, s_vs,
                                s_vh, s_sp, s_ss, s_sh, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE, True,
                                DOT_PREC, FP8)
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (start + tok)[:, None] * s_on + head[:, None] * s_oh + offs_d[None, :],
             res.to(o_ptr.dtype.element_ty), mask=io_mask)


TILES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters: M tile (flattened token x group-head rows), K/V tile, warps, stages,
    and whether each K/V tile's page ids are loaded a tile ahead (`pages_ahead`: what the
    decode kernels do; not yet timed here, so off by default, and kernels_prefill_attn.py
    sweeps both)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    pages_ahead: bool = False

    def __post_init__(self) -> None:
        if self.block_m not in TILES or self.block_n not in TILES:
            raise ConfigError(f"prefill tiles {self.block_m}x{self.block_n} must be in {TILES}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ConfigError(f"prefill num_warps={self.num_warps} must be a power of two <= 16"
                              f" and num_stages={self.num_stages} >= 1")


def default_config(dtype: torch.dtype = torch.bfloat16, fp8_kv: bool = False) -> PrefillConfig:
    """Hopper defaults. bench/kernels/kernels_prefill_attn.py at Llama-3-8B and 70B tp=8 heads,
    512-2,048 tokens, fresh and continuing chunks: over a bf16 cache (H100) 64x64 tiles, 4 warps,
    3 stages were fastest in 11 of 16 cases and within 30% in the rest; over an e4m3 cache (H200,
    `--kv-dtype fp8`) 64x128, 4 warps, 2 stages were fastest in 7 of 8 cases, 1.2-1.35x the
    bf16 default at 1,024-2,048 tokens (e4m3 K/V tiles are half the bytes). fp32 (tests) keeps 2
    stages: its tiles are twice the bytes."""
    if dtype == torch.float32:
        return PrefillConfig(64, 64, 4, 2)
    if fp8_kv:
        return PrefillConfig(64, 128, 4, 2)
    return PrefillConfig(64, 64, 4, 3)


def grid(num_rows: int, num_segments: int, num_kv_heads: int, group: int,
         block_m: int) -> tuple[int, int]:
    """(a bound on the m-tiles of all segments, KV heads). Segments hold at most `num_rows` rows
    in all, and each adds at most one partial tile: the bound depends on shapes only, so a CUDA
    graph replays it with any segments of the same row count and segment slots."""
    return (math.ceil(num_rows * group / block_m) + num_segments, num_kv_heads)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor,
                      segments: Sequence[Segment] | PrefillSegments, scale: float,
                      out: torch.Tensor, config: PrefillConfig | None = None, *,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Triton paged causal prefill attention; see the module docstring for shapes.

    segments: (start, end, first_pos) tuples (turned into device tensors: one small H2D copy) or
    prebuilt `PrefillSegments` (no host work: what a CUDA graph captures).
    """
    if not isinstance(segments, PrefillSegments):
        segments = PrefillSegments.build(segments, q.device)
    _check(q, k_cache, v_cache, block_tables, segments, out)
    n, num_q, d = q.shape
    num_kv, page = k_cache.shape[2], k_cache.shape[1]
    if n == 0 or segments.num_segments == 0:
        return
    fp8 = k_scale is not None
    cfg = config or default_config(q.dtype, fp8)
    group = num_q // num_kv
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)  # unused without FP8
    _prefill_kernel[grid(n, segments.num_segments, num_kv, group, cfg.block_m)](
        q, k_cache, v_cache, ks, vs, block_tables, segments.start, segments.length,
        segments.first_pos, out, scale * LOG2E, segments.num_segments,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        *ks.stride()[:3], block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PAGE=page,
        BLOCK_S=max(2, triton.next_power_of_2(segments.num_segments)),
        DOT_PREC=dot_precision(q.dtype), FP8=fp8,
        F16_DOTS=fp8 and q.dtype == torch.bfloat16, PAGES_AHEAD=cfg.pages_ahead,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, segments: PrefillSegments, out: torch.Tensor) -> None:
    """Refuse shapes the kernel would read or write out of bounds (host metadata only)."""
    n, num_q, d = q.shape
    if out.shape != q.shape or k_cache.shape != v_cache.shape or k_cache.shape[3] != d:
        raise ConfigError(f"prefill shapes disagree: q {list(q.shape)}, out {list(out.shape)}, "
                          f"k_cache {list(k_cache.shape)}, v_cache {list(v_cache.shape)}")
    if num_q % k_cache.shape[2]:
        raise ConfigError(f"{num_q} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ConfigError("prefill attention needs the head dim contiguous in q, out and the cache")
    if block_tables.shape[0] < segments.num_segments:
        raise ConfigError(f"block_tables has {block_tables.shape[0]} rows for "
                          f"{segments.num_segments} segments")
    if segments.host is not None and any(e > n for _, e, _ in segments.host):
        raise ConfigError(f"a prefill segment ends past the {n} rows of q")
