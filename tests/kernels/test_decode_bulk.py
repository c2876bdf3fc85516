"""The `cuda_bulk` decode attention's host side: work planning, the reasons it refuses a call,
and how the dispatcher and the profiler know it. The kernel itself runs only on a Hopper GPU
(tests/gpu/test_kernels_gpu.py checks it against the reference there)."""

import math

import pytest
import torch

from nanosched.errors import ConfigError
from nanosched.kernels import decode_attn_bulk as bulk
from nanosched.kernels import dispatch, impls


@pytest.mark.parametrize("n, ctx, grid", [(64, 1024, 132), (256, 4096, 32), (1, 16, 8),
                                          (640, 8192, 16), (3, 1, 132), (64, 100_000, 132)])
def test_the_plan_covers_every_page_once_with_about_two_items_per_cta(n, ctx, grid):
    splits, per = bulk.plan(n, ctx, grid)
    pages = math.ceil(ctx / bulk.PAGE)
    assert splits * per >= pages > (splits - 1) * per  # every page in exactly one split
    assert per >= min(pages, bulk.MIN_SPLIT_PAGES)
    if pages >= bulk.MIN_SPLIT_PAGES * splits and splits > 1:
        assert n * splits >= bulk.ITEMS_PER_CTA * grid * 0.5
    assert bulk.plan(n, ctx, grid, num_splits=3)[0] == min(3, pages)


def test_shared_memory_fits_an_h100_sm_for_llama3_heads():
    assert bulk.smem_bytes(8, 128) <= 227 * 1024
    assert bulk.SOURCE.is_file()  # shipped with the package (setup.py package_data)


def test_an_fp8_ring_holds_each_page_half_and_its_scales():
    """e4m3: a slot is a page's K (or V), 16 KB for 8 heads of 128 dims, plus its 512 B of
    scales, rounded to 1 KB for the swizzle; the same 192 KB then hold 11 slots (5.5 pages,
    against 3 of bf16)."""
    assert bulk.slot_bytes(8, 128, fp8=True) == 17 * 1024
    assert bulk.page_slots(128, fp8=True) == 2 and bulk.slot_boxes(128, fp8=True) == 1
    assert bulk.ring_slots(8, 128, 227 * 1024, fp8=True) == 11
    assert bulk.smem_bytes(8, 128, fp8=True) <= 227 * 1024
    assert bulk.ring_slots(8, 128, 227 * 1024) == 6  # bf16, unchanged


def cache(dtype=torch.bfloat16, page=16, kv=8, d=128, device="cpu"):
    k = torch.zeros(4, page, kv, d, dtype=dtype, device=device)
    return k, torch.zeros_like(k)


@pytest.mark.parametrize("change, q_shape, words", [
    (dict(), (2, 32, 128), "CUDA GPU only"),
    (dict(dtype=torch.float32), (2, 32, 128), "bf16 or fp16"),
    (dict(page=32), (2, 32, 128), "16-token pages"),
    (dict(d=96), (2, 32, 96), "head_dim % 64"),
    (dict(kv=2), (2, 32, 128), "at most 8 query heads"),
])
def test_unsupported_names_the_reason(change, q_shape, words):
    k, v = cache(**change)
    q = torch.zeros(q_shape, dtype=torch.bfloat16)
    assert words in bulk.unsupported(q, k, v)


def fp8_cache(pages=4, kv=8, d=128):
    k, v = cache(dtype=torch.float8_e4m3fn, kv=kv, d=d)
    return k, v, torch.ones(pages, 16, kv), torch.ones(pages, 16, kv)


def test_an_fp8_cache_is_read_with_its_scales_or_refused_with_the_reason():
    k, v, ks, vs = fp8_cache()
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    assert bulk.unsupported(q, k, v, ks, vs) == "it runs on a CUDA GPU only"  # all else fits
    assert "both k_scale and v_scale" in bulk.unsupported(q, k, v, ks)
    assert "float8_e4m3fn" in bulk.unsupported(q, *cache(), ks, vs)
    assert "k_scale fp32 [4, 16, 8]" in bulk.unsupported(q, k, v, ks.double(), vs)
    assert "v_scale fp32" in bulk.unsupported(q, k, v, ks, vs[:, :, :4])
    assert "v_scale fp32" in bulk.unsupported(q, k, v, ks, vs.transpose(1, 2).contiguous()
                                              .transpose(1, 2))
    assert "bf16 or fp16 q" in bulk.unsupported(q.float(), k, v, ks, vs)
    k64, v64, ks64, vs64 = fp8_cache(d=64)  # a 64-dim row is half a 128-byte box row
    assert "head_dim % 128" in bulk.unsupported(torch.zeros(2, 32, 64, dtype=torch.bfloat16),
                                                k64, v64, ks64, vs64)


def test_a_cache_whose_pages_are_not_contiguous_is_refused():
    k, v = cache()
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    wide = torch.zeros(4, 16, 8, 256, dtype=torch.bfloat16)[..., :128]  # rows 512 B apart
    assert "contiguous" in bulk.unsupported(q, wide, v)


def test_the_dispatcher_refuses_it_with_the_reason_where_it_cannot_run():
    k, v = cache()
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    tables = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    with pytest.raises(ConfigError, match="cuda_bulk.*cannot run"):
        dispatch.decode_attention(q, k, v, tables, lens, 9, 0.1, torch.empty_like(q),
                                  dispatch.KernelOptions(), {"impl": "cuda_bulk"})


def test_it_is_a_decode_implementation_the_profiler_knows():
    from nanosched.profiler import impl_registry
    from nanosched.profiler.runner import PARTITION_MEMORY_IMPLS

    assert impls.check_op_impl("attn_decode", "cuda_bulk") == "cuda_bulk"
    runnable, notes = impl_registry.available(["attn_decode"])
    reason = impl_registry.bulk_missing()
    if reason is None:
        assert "cuda_bulk" in [i.name for i in runnable["attn_decode"]]
    else:  # a machine without cupy (CI): the profile says why it skipped it
        assert "not installed" in reason
        assert any("attn_decode/cuda_bulk not measured" in n for n in notes)
    assert "cuda_bulk" in PARTITION_MEMORY_IMPLS


@pytest.mark.parametrize("launch", [{"num_sms": 32}, {}, {"max_ctas": 16}])
def test_the_dispatcher_passes_cuda_bulk_its_cta_bound_or_its_sms(monkeypatch, launch):
    seen = {}
    monkeypatch.setattr(bulk, "decode_attention", lambda *a, **kw: seen.update(kw))
    q, k = torch.zeros(2, 4, 8), torch.zeros(1, 16, 1, 8)
    dispatch.decode_attention(q, k, k, torch.zeros(2, 1, dtype=torch.int32),
                              torch.ones(2, dtype=torch.int32), 1, 0.1, torch.empty_like(q),
                              dispatch.KernelOptions(), {"impl": "cuda_bulk", **launch})
    assert (seen["max_ctas"], seen["sms"]) == (launch.get("max_ctas"), launch.get("num_sms"))


@pytest.mark.parametrize("fp8, max_ctas, sms, grid, per_sm, slots", [
    (True, None, 16, 32, 2, 6), (True, None, 48, 96, 2, 6),  # two CTAs an SM, half a ring each
    (True, None, 64, 64, 1, 11), (True, None, 132, 132, 1, 11),  # one, the whole ring
    (True, 16, None, 16, 1, 11),  # a CTA bound: each CTA its own SM and the whole ring
    (False, None, 32, 32, 1, 6), (False, 16, None, 16, 1, 6)])
def test_an_fp8_cache_on_few_sms_launches_two_ctas_per_sm_each_with_half_the_ring(
        monkeypatch, fp8, max_ctas, sms, grid, per_sm, slots):
    monkeypatch.setattr(bulk, "_device_limits", lambda index: (9, 227 * 1024))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(4, 16, 8, 128, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    build, got = bulk.kernel_and_grid(q, k, fp8, max_ctas, sms)
    assert (got, build.ctas_per_sm, build.slots) == (grid, per_sm, slots)
    assert build.ctas_per_sm * (build.smem + 1024) <= bulk.SM_SMEM


def test_where_two_rings_do_not_fit_an_sm_one_cta_runs_there(monkeypatch):
    """Heads whose two-page ring needs more than half an SM: one CTA per SM, the grid its SMs."""
    monkeypatch.setattr(bulk, "_device_limits", lambda index: (9, 227 * 1024))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    q = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    k = torch.zeros(4, 16, 16, 128, dtype=torch.float8_e4m3fn)  # 16 KV heads: 33 KB slots
    build, grid = bulk.kernel_and_grid(q, k, True, None, 32)
    assert (build.ctas_per_sm, grid) == (1, 32) and build.slots >= 4


@pytest.mark.parametrize("ctx, splits", [(1, 2), (16, 2), (328, 2), (2328, 2), (64, 4), (4096, 3)])
def test_partial_pages_cut_a_context_into_exactly_that_many_splits(ctx, splits):
    per = bulk.partial_pages(ctx, splits)
    pages = max(splits, math.ceil(ctx / bulk.PAGE))
    assert per is not None and math.ceil(pages / per) == splits and per * splits >= pages


def test_partial_pages_says_when_no_count_fits():
    assert bulk.partial_pages(5 * bulk.PAGE, 4) is None  # 5 pages: 2 a split gives 3 splits


def test_decode_partials_refuses_buffers_it_would_misread():
    """The caller's partial buffers are checked before any GPU work: their shape, dtype,
    layout, at least two splits, and a split count the context cuts into exactly."""
    q = torch.zeros(3, 32, 128, dtype=torch.bfloat16)
    kc = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    tables, lens = torch.zeros(3, 4, dtype=torch.int32), torch.ones(3, dtype=torch.int32)

    def call(part, lse, ctx=64):
        bulk.decode_partials(q, kc, kc, tables, lens, ctx, 0.1, part, lse)

    good = torch.zeros(3, 32, 2, 128), torch.zeros(3, 32, 2)
    for part, lse in [(torch.zeros(3, 32, 1, 128), torch.zeros(3, 32, 1)),
                      (good[0].half(), good[1]), (good[0], torch.zeros(3, 32, 3)),
                      (torch.zeros(3, 32, 128, 2).transpose(2, 3), good[1])]:
        with pytest.raises(ConfigError, match="cuda_bulk partials: part"):
            call(part, lse)
    with pytest.raises(ConfigError, match="80 tokens do not cut into 4 splits"):
        call(torch.zeros(3, 32, 4, 128), torch.zeros(3, 32, 4), ctx=80)
