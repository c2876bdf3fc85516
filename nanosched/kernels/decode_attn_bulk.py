"""`cuda_bulk`: paged GQA decode attention for a few SMs, a CUDA kernel built at run time.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from nanosched.errors import ConfigError
from nanosched.kernels.common import num_sms

SOURCE = Path(__file__).with_name("decode_attn_bulk.cu")
PAGE = 16  # tokens per page the kernel handles (one mma tile of 16 tokens)
# The ring: RING_BYTES of slots, each of SLOT_BOXES boxes (a box: 64 dims x 16 tokens x all KV
# heads of K or V, one tensor copy; 16 KB for 8 KV heads; None: a page's K or V, head_dim / 64
# boxes). A slot is given back as soon as its boxes are read, so all of the ring but one slot
# can be in flight: 160-192 KB of a 192 KB ring of 32 KB slots, against 128 KB for three whole
# pages. On 32 H100 SMs a 224 KB ring (7 x 32 KB, 14 x 16 KB) read 1.5-2.5 points of copy less,
# and 16 KB slots (K and V given back per 64 dims) 1-3 points less than 32 KB ones
# (bench/kernels/kernels_decode_bulk_ring.py).
SLOT_BOXES: int | None = None
RING_BYTES = 192 * 1024
MIN_RING_PAGES = 2  # a ring that fits fewer slots than two pages' is refused
HOPPER_SMEM = 227 * 1024  # shared memory a block may opt into on an H100 / H200
# A diagnostic for benchmarks only: True builds the kernel with consumers that take and give
# back each slot without reading it (the .cu's CONSUME_ONLY), so its time is the ring's copy
# ceiling and its output zeros (bench/kernels/kernels_decode_attn.py --kernels cuda_bulk_consume).
CONSUME_ONLY = False
# CTAs sharing an SM with an FP8 cache on at most FP8_SHARED_MAX_SMS SMs, each with its share
# of the SM's shared memory for its ring. The FP8 consumers are bound by the latency of their
# conversion -> mma chains (Nsight Compute: a scheduler issues every 2.1 cycles, a fixed-latency
# dependency the first stall), and two CTAs give an SM twice the consumer warps at the same
# bytes in flight: 1.27-1.31x on partitions of 16 H100 SMs, 1.07-1.30x on 32, 1.03-1.24x on 48;
# on 64 and on all 132 the two are within 7% either way, and one CTA keeps the whole ring
# (docs/findings.md; every variant tried: docs/notebook/2026-11-26-fp8-on-few-sms.md).
# bench/kernels/kernels_decode_attn.py --kernels cuda_bulk_1cta sets one.
FP8_CTAS_PER_SM = 2
FP8_SHARED_MAX_SMS = 48
SM_SMEM = 228 * 1024  # shared memory of an H100 / H200 SM, 1 KB of it reserved per CTA
MIN_SPLIT_PAGES = 4
ITEMS_PER_CTA = 2
# The merge is a loop of small dependent loads per (request, head): several light programs per
# CTA of the partial kernel (one per SM) keep it from being latency-bound.
MERGE_PROGRAMS_PER_CTA = 4


def box_dims(fp8: bool = False) -> int:
    """Dims of one box: a 128-byte row of the cache's elements."""
    return 128 if fp8 else 64


def slot_boxes(head_dim: int, fp8: bool = False) -> int:
    """Boxes in one ring slot: SLOT_BOXES, or a page's K (or V) when None (always with an FP8
    cache, whose slot also holds the page's scales)."""
    whole = head_dim // box_dims(fp8)
    return whole if fp8 else SLOT_BOXES or whole


def slot_bytes(num_kv_heads: int, head_dim: int, fp8: bool = False) -> int:
    """Bytes of one ring slot: its boxes of 128-byte rows x PAGE tokens x the KV heads, and
    with an FP8 cache the page's fp32 scales (PAGE x KV heads), 1024-byte aligned."""
    size = slot_boxes(head_dim, fp8) * 128 * PAGE * num_kv_heads
    if fp8:
        size = -(-(size + 4 * PAGE * num_kv_heads) // 1024) * 1024
    return size


def page_slots(head_dim: int, fp8: bool = False) -> int:
    """Slots one page's K and V fill."""
    return 2 * (head_dim // box_dims(fp8)) // slot_boxes(head_dim, fp8)


def ctas_per_sm(fp8: bool, sms: int) -> int:
    """CTAs of the persistent grid per SM when it runs on `sms` SMs: FP8_CTAS_PER_SM with an
    FP8 cache on at most FP8_SHARED_MAX_SMS of them, else one."""
    return FP8_CTAS_PER_SM if fp8 and sms <= FP8_SHARED_MAX_SMS else 1


def cta_smem(limit: int, per_sm: int = 1) -> int:
    """Shared memory one CTA may take: `limit` (what a block may opt into), or its share of
    an SM's when `per_sm` CTAs share one."""
    return limit if per_sm == 1 else min(limit, SM_SMEM // per_sm - 1024)


def smem_bytes(num_kv_heads: int, head_dim: int, slots: int | None = None,
               fp8: bool = False) -> int:
    """Dynamic shared memory of one CTA: a ring of `slots` slots (default: the ring an H100 /
    H200 gives one CTA an SM), 1024-byte aligned for the swizzle, and their 2 x `slots`
    mbarriers."""
    if slots is None:
        slots = (ring_slots(num_kv_heads, head_dim, HOPPER_SMEM, fp8)
                 or MIN_RING_PAGES * page_slots(head_dim, fp8))
    return slots * slot_bytes(num_kv_heads, head_dim, fp8) + 1024 + 16 * slots


def ring_slots(num_kv_heads: int, head_dim: int, limit: int, fp8: bool = False) -> int:
    """Slots of the ring under `limit` bytes of shared memory: RING_BYTES' worth, at least
    MIN_RING_PAGES pages', no more than fit (0 when those pages do not fit)."""
    size = slot_bytes(num_kv_heads, head_dim, fp8)
    need = MIN_RING_PAGES * page_slots(head_dim, fp8)
    slots = min(max(need, RING_BYTES // size), (limit - 1024) // (size + 16))
    return slots if slots >= need else 0


@functools.cache
def _device_limits(index: int) -> tuple[int, int]:
    """(compute capability major, shared memory a block may opt into) of GPU `index`, read once:
    every launch checks them."""
    props = torch.cuda.get_device_properties(index)
    return props.major, props.shared_memory_per_block_optin


def unsupported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> str | None:
    """Why this kernel cannot run the call, or None."""
    n, num_q, d = q.shape
    page, num_kv = k_cache.shape[1], k_cache.shape[2]
    fp8 = k_scale is not None or v_scale is not None
    if fp8:
        why = _fp8_unsupported(k_cache, v_cache, k_scale, v_scale)
        if why:
            return why
        if q.dtype not in (torch.bfloat16, torch.float16):
            return f"it needs bf16 or fp16 q, got {q.dtype}"
    elif q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype \
            or v_cache.dtype != q.dtype:
        return f"it needs bf16 or fp16 q and cache of one dtype, got {q.dtype}, {k_cache.dtype}"
    if page != PAGE:
        return f"it needs {PAGE}-token pages, got {page}"
    dims = box_dims(fp8)
    if d % dims or num_q % num_kv or num_q // num_kv > 8 or num_kv > 16:
        return (f"it needs head_dim % {dims} == 0, at most 8 query heads per KV head and at most "
                f"16 KV heads; got d={d}, Hq={num_q}, Hkv={num_kv}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride()[1:] != (num_kv * d, d, 1) or t.stride(0) * t.element_size() % 16 \
                or t.data_ptr() % 16:
            return f"it needs each page of {name} contiguous and 16-byte aligned"
    if v_cache.stride(0) != k_cache.stride(0):
        return "it needs k_cache and v_cache with one page stride"
    if q.stride(2) != 1 or q.stride(1) % 2 or q.stride(0) % 2:
        return "it needs q's rows contiguous and 4-byte aligned"
    if q.device.type != "cuda":
        return "it runs on a CUDA GPU only"
    major, limit = _device_limits(q.device.index if q.device.index is not None
                                  else torch.cuda.current_device())
    if major < 9:
        return "it needs an sm_90 (Hopper) GPU or newer: tensor-map copies"
    if not ring_slots(num_kv, d, limit, fp8):  # one CTA per SM, the whole ring, at least
        smem = smem_bytes(num_kv, d, MIN_RING_PAGES * page_slots(d, fp8), fp8)
        return f"its ring needs {smem} B of shared memory, the GPU offers {limit}"
    return None


def _fp8_unsupported(k_cache: torch.Tensor, v_cache: torch.Tensor,
                     k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> str | None:
    """Why an FP8 cache with these scales cannot be read, or None: e4m3 K and V, fp32 scales
    [P, PAGE, Hkv] (one per token and KV head), each page's block contiguous and 16-byte
    aligned (one bulk copy), one page stride for K's and V's."""
    if k_scale is None or v_scale is None:
        return "an FP8 cache needs both k_scale and v_scale"
    if k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != torch.float8_e4m3fn:
        return f"its FP8 cache must be float8_e4m3fn, got {k_cache.dtype}, {v_cache.dtype}"
    pages, page, num_kv = k_cache.shape[:3]
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.dtype != torch.float32 or tuple(t.shape) != (pages, page, num_kv) \
                or t.stride()[1:] != (num_kv, 1) or t.stride(0) % 4 or t.data_ptr() % 16:
            return (f"it needs {name} fp32 [{pages}, {page}, {num_kv}], each page's block "
                    f"contiguous and 16-byte aligned; got {t.dtype} {tuple(t.shape)} strides "
                    f"{t.stride()}")
    if k_scale.stride(0) != v_scale.stride(0):
        return "it needs k_scale and v_scale with one page stride"
    return None


@functools.cache
def missing_dependency() -> str | None:
    """Why the kernel cannot be built on this machine (no cupy or cuda-bindings), or None."""
    try:
        import cupy  # noqa: F401
        from cuda.bindings import driver  # noqa: F401
    except ImportError as err:
        return (f"{err.name} is not installed (pip install cupy-cuda13x cuda-bindings, or the "
                f"cuda12 flavours)")
    return None


class _Build(NamedTuple):
    """What one compiled kernel is specialised to (the .cu's defines) and the GPU it loads on."""

    num_kv: int
    group: int
    head_dim: int
    f16: bool
    device: int
    slots: int
    boxes: int
    fp8: bool
    consume_only: bool
    ctas_per_sm: int

    @property
    def threads(self) -> int:
        return 32 * (self.num_kv + 1)  # a consumer warp per KV head and the producer

    @property
    def smem(self) -> int:
        return smem_bytes(self.num_kv, self.head_dim, self.slots, self.fp8)


def _build(q: torch.Tensor, k_cache: torch.Tensor, fp8: bool, per_sm: int) -> _Build:
    """The kernel a call on `q` and `k_cache` runs, `per_sm` CTAs sharing an SM (a ring each:
    at least MIN_RING_PAGES pages, else one CTA per SM)."""
    num_kv, d = k_cache.shape[2], q.shape[2]
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    limit = _device_limits(dev)[1]
    slots = ring_slots(num_kv, d, cta_smem(limit, per_sm), fp8)
    if not slots:
        per_sm, slots = 1, ring_slots(num_kv, d, limit, fp8)
    return _Build(num_kv, q.shape[1] // num_kv, d, q.dtype == torch.float16, dev, slots,
                  slot_boxes(d, fp8), fp8, CONSUME_ONLY, per_sm)


@functools.cache
def _kernel(b: _Build):
    import cupy

    with cupy.cuda.Device(b.device):
        module = cupy.RawModule(code=SOURCE.read_text(), options=(
            "-std=c++17", f"-DHKV={b.num_kv}", f"-DGROUP={b.group}", f"-DHEAD_DIM={b.head_dim}",
            f"-DSLOTS={b.slots}", f"-DSLOT_BOXES={b.boxes}", f"-DF16={int(b.f16)}",
            f"-DKV_FP8={int(b.fp8)}", f"-DCONSUME_ONLY={int(b.consume_only)}",
            f"-DMIN_BLOCKS={b.ctas_per_sm}"))
        kernel = module.get_function("decode_bulk")
        kernel.max_dynamic_shared_size_bytes = b.smem
    return kernel


@functools.cache
def _build_error(b: _Build) -> str | None:
    try:
        _kernel(b)
    except Exception as exc:  # noqa: BLE001 - NVRTC, the driver or cupy: any failure, said
        return f"{type(exc).__name__}: {exc}"
    return None


def kernel_and_grid(q: torch.Tensor, k_cache: torch.Tensor, fp8: bool, max_ctas: int | None,
                    sms: int | None) -> tuple[_Build, int]:
    """The kernel and grid of a call: under a CTA bound (`max_ctas`), `max_ctas` CTAs of one
    per SM (the whole ring); on `sms` SMs (default: the device's), `ctas_per_sm` CTAs on each
    where that many rings fit an SM, else one."""
    if max_ctas:
        return _build(q, k_cache, fp8, 1), max_ctas
    sms = sms or num_sms(q.device)
    build = _build(q, k_cache, fp8, ctas_per_sm(fp8, sms))
    return build, build.ctas_per_sm * sms


def build_error(q: torch.Tensor, k_cache: torch.Tensor, fp8: bool) -> str | None:
    """Why the kernel for this call's shapes cannot be compiled (NVRTC) and loaded on q's GPU,
    or None; each shape is built once (here the whole GPU's). For a call `unsupported` accepts."""
    return _build_error(kernel_and_grid(q, k_cache, fp8, None, None)[0])


_MAPS: dict[tuple, torch.Tensor] = {}


def _encode(t: torch.Tensor) -> bytes:
    """The 128-byte tensor map of a paged cache [P, PAGE, Hkv, d]: dims ordered (d, token, head,
    page) and boxes of one 128-byte row of dims (64 of bf16/fp16, 128 of e4m3) x PAGE tokens x
    Hkv heads, 128-byte swizzle."""
    import ctypes

    from cuda.bindings import driver as drv

    pages, page, num_kv, d = t.shape
    size = t.element_size()
    types = drv.CUtensorMapDataType
    dtype = {torch.float16: types.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
             torch.float8_e4m3fn: types.CU_TENSOR_MAP_DATA_TYPE_UINT8}.get(
                 t.dtype, types.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t
    err, tmap = drv.cuTensorMapEncodeTiled(
        dtype, 4, t.data_ptr(), [u64(x) for x in (d, page, num_kv, pages)],
        [u64(x * size) for x in (t.stride(1), t.stride(2), t.stride(0))],
        [u32(x) for x in (128 // size, page, num_kv, 1)], [u32(1)] * 4,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise ConfigError(f"cuTensorMapEncodeTiled failed ({err}) for a cache of shape "
                          f"{tuple(t.shape)}, strides {t.stride()}")
    return ctypes.string_at(tmap.getPtr(), 128)


def tensor_maps(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """The K and V tensor maps in device memory (256 bytes, K first), built once per cache view
    (a CUDA graph replays the pointer, so the first call must not be captured)."""
    key = (k_cache.data_ptr(), v_cache.data_ptr(), tuple(k_cache.shape), k_cache.stride(),
           k_cache.dtype, k_cache.device)
    maps = _MAPS.get(key)
    if maps is None:
        raw = bytearray(_encode(k_cache) + _encode(v_cache))
        maps = torch.frombuffer(raw, dtype=torch.uint8).to(k_cache.device)
        _MAPS[key] = maps
    return maps


@functools.cache
def _stream(handle: int, device: int):
    import cupy

    with warnings.catch_warnings():  # cupy 14 deprecates it for Stream.from_external
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, device)


def plan(num_requests: int, max_context_len: int, grid: int,
         num_splits: int | None = None) -> tuple[int, int]:
    """(splits, pages per split): about ITEMS_PER_CTA work items per CTA, at least
    MIN_SPLIT_PAGES pages each (or `num_splits` when given)."""
    pages = max(1, math.ceil(max_context_len / PAGE))
    if num_splits is None:
        num_splits = min(math.ceil(ITEMS_PER_CTA * grid / max(1, num_requests)),
                         math.ceil(pages / MIN_SPLIT_PAGES))
    num_splits = max(1, min(num_splits, pages))
    per = math.ceil(pages / num_splits)
    return math.ceil(pages / per), per


def _check_call(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor | None,
                k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether the call reads an FP8 cache; ConfigError names every reason it cannot run."""
    fp8 = k_scale is not None or v_scale is not None
    why = missing_dependency() or unsupported(q, k_cache, v_cache, k_scale, v_scale)
    if not why and (context_lens.dtype != torch.int32 or block_tables.dtype != torch.int32):
        why = "it needs int32 block tables and context lengths"
    if not why and out is not None and (out.dtype != q.dtype or out.stride(2) != 1):
        why = "it writes out in q's dtype, each head's row contiguous"
    if why:
        raise ConfigError(f"decode attention 'cuda_bulk' cannot run: {why}")
    return fp8


def _launch(build: _Build, grid: int, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
            scale: float, out: torch.Tensor, part: torch.Tensor, lse: torch.Tensor,
            splits: int, per: int, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None) -> None:
    """One launch over n x `splits` items of `per` pages: one split writes `out`, several write
    `part` [n, Hq, splits, d] and `lse` [n, Hq, splits] (contiguous)."""
    n = q.shape[0]
    items = n * splits
    bt = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    kernel = _kernel(build)
    maps = tensor_maps(k_cache, v_cache)
    args = (np.uint64(q.data_ptr()), np.uint64(maps.data_ptr()), np.uint64(bt.data_ptr()),
            np.uint64(context_lens.data_ptr()), np.uint64(out.data_ptr()),
            np.uint64(part.data_ptr()), np.uint64(lse.data_ptr()), np.int32(items),
            np.int32(splits), np.int32(per), np.int32(bt.stride(0)), np.int32(bt.shape[1]),
            np.int64(q.stride(0)), np.int64(q.stride(1)), np.int64(out.stride(0)),
            np.int64(out.stride(1)),
            np.float32(scale * math.log2(math.e)))
    if k_scale is not None:  # the FP8 kernel's scales: pointers and their page stride (floats)
        args += (np.uint64(k_scale.data_ptr()), np.uint64(v_scale.data_ptr()),
                 np.int64(k_scale.stride(0)))
    with _stream(torch.cuda.current_stream(q.device).cuda_stream, build.device):
        kernel((min(grid, items),), (build.threads,), args, shared_mem=build.smem)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     max_context_len: int, scale: float, out: torch.Tensor,
                     max_ctas: int | None = None, num_splits: int | None = None, *,
                     sms: int | None = None,
                     k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> None:
    """The `cuda_bulk` decode attention; contract of reference.decode_attention (an FP8 cache:
    e4m3 K/V with `k_scale`, `v_scale`; ConfigError names every reason a call cannot run here).
    Its grid: a CTA bound of `max_ctas`, else `sms` SMs' worth (`kernel_and_grid`)."""
    n, num_q, d = q.shape
    if n == 0:
        return
    fp8 = _check_call(q, k_cache, v_cache, block_tables, context_lens, out, k_scale, v_scale)
    build, grid = kernel_and_grid(q, k_cache, fp8, max_ctas, sms)
    splits, per = plan(n, max_context_len, grid, num_splits)
    if splits == 1:
        part = lse = out  # unused by the kernel
    else:
        part = torch.empty((n, num_q, splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((n, num_q, splits), dtype=torch.float32, device=q.device)
    _launch(build, grid, q, k_cache, v_cache, block_tables, context_lens, scale, out, part, lse,
            splits, per, k_scale, v_scale)
    if splits > 1:
        from nanosched.kernels.decode_attn import merge_splits

        merge_splits(part, lse, out, MERGE_PROGRAMS_PER_CTA * grid)


def partial_pages(max_context_len: int, splits: int) -> int | None:
    """Pages per split that cut `max_context_len` tokens into exactly `splits` splits (at
    least `splits` pages counted), or None where no count does."""
    pages = max(splits, math.ceil(max_context_len / PAGE))
    per = math.ceil(pages / splits)
    return per if math.ceil(pages / per) == splits else None


def decode_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    max_context_len: int, scale: float, part: torch.Tensor, lse: torch.Tensor,
                    *, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Each row's context in S = part.shape[2] >= 2 splits of whole pages, unmerged: part
    [n, Hq, S, d] fp32 (each split normalised) and lse [n, Hq, S] (natural log; a split with no
    tokens writes zeros and -inf), both contiguous, for a caller that merges them with partials
    of its own (cascade attention's suffix). The whole GPU's grid, as the default launch."""
    n, num_q, d = q.shape
    splits = part.shape[2]
    if part.shape != (n, num_q, splits, d) or lse.shape != (n, num_q, splits) or splits < 2 \
            or not part.is_contiguous() or not lse.is_contiguous() \
            or part.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ConfigError(f"cuda_bulk partials: part {tuple(part.shape)} and lse "
                          f"{tuple(lse.shape)} must be contiguous fp32 [{n}, {num_q}, S, {d}] "
                          f"and [{n}, {num_q}, S], S >= 2")
    per = partial_pages(max_context_len, splits)
    if per is None:
        raise ConfigError(f"cuda_bulk partials: {max_context_len} tokens do not cut into "
                          f"{splits} splits of whole {PAGE}-token pages; use 2")
    if n == 0:
        return
    fp8 = _check_call(q, k_cache, v_cache, block_tables, context_lens, None, k_scale, v_scale)
    build, grid = kernel_and_grid(q, k_cache, fp8, None, None)
    _launch(build, grid, q, k_cache, v_cache, block_tables, context_lens, scale, q, part, lse,
            splits, per, k_scale, v_scale)  # `out` (q here) is not written with several splits
