"""KV offload: the swap-or-recompute cost rule, and host swap round trips on the CPU path."""

from types import SimpleNamespace

import pytest
import torch

from nanosched.models.kvcache import KVCache
from nanosched.models.spec import load_spec
from nanosched.runtime.offload import HostSwap, SwapCost, prefer_swap, swap_cost


def llama3_8b_cost(gemm_tflops, link_gb_s):
    spec = load_spec("llama3-8b")
    kv = KVCache(spec.num_layers, 2, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
    model = SimpleNamespace(spec=spec, tp=SimpleNamespace(size=1))
    return swap_cost(model, kv, link_gb_s, gemm_tflops), spec


def test_cost_figures_come_from_the_cache_and_the_model():
    cost, spec = llama3_8b_cost(gemm_tflops=400, link_gb_s=25)
    assert cost.kv_bytes_per_token == spec.kv_bytes_per_token() == 131072  # bf16, GQA 8 heads
    assert cost.flops_per_token == 2 * 8030261248
    assert cost.attn_flops_per_token2 == 2 * 32 * 32 * 128
    # 1,024 tokens: 268 MB over 25 GB/s = 10.7 ms vs 16.7 TFLOP at 400 TFLOP/s = 41.8 ms
    assert cost.swap_s(1024) == pytest.approx(2 * 1024 * 131072 / 25e9)
    assert cost.recompute_s(1024) == pytest.approx((1024 * 2 * 8030261248 + 1024**2 * 262144)
                                                   / 400e12)
    assert prefer_swap(1024, cost)
    # a slow link (2 GB/s: 134 ms) beside a fast GPU (761 TFLOP/s: 22 ms): recompute
    assert prefer_swap(1024, llama3_8b_cost(gemm_tflops=761, link_gb_s=2)[0]) is False


def test_cost_rule_swaps_long_contexts_and_recomputes_short_ones():
    # 2 us/token to copy out and back; 1 us/token of GEMMs plus n * 0.01 us of attention
    cost = SwapCost(kv_bytes_per_token=1000, flops_per_token=1e8, attn_flops_per_token2=1e6,
                    link_bytes_per_s=1e9, flops_per_s=1e14)
    assert not prefer_swap(50, cost) and not prefer_swap(100, cost)  # crossover at n = 100
    assert prefer_swap(101, cost) and prefer_swap(4096, cost)
    assert not prefer_swap(0, cost)  # nothing cached: nothing to copy, nothing to recompute


def filled_cache(pages=8):
    kv = KVCache(num_layers=2, num_pages=pages, num_kv_heads=2, head_dim=3,
                 dtype=torch.float32, page_size=4)
    kv.k.normal_(generator=torch.Generator().manual_seed(0))
    kv.v.normal_(generator=torch.Generator().manual_seed(1))
    return kv


def context(kv, request):
    """[L, n, Hkv, d] of K and V over the request's written positions."""
    table, n = kv.tables[request], kv.length(request)
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(n)])
    flat = [t.flatten(1, 2)[:, slots] for t in kv.page_tensors()]
    return torch.cat(flat)


def test_swap_out_and_in_moves_every_page_tensor_and_frees_the_pages():
    kv = filled_cache()
    kv.plan([(5, 10, False)])  # 10 tokens: 3 pages
    before = context(kv, 5).clone()
    swap = HostSwap(kv, capacity_bytes=10**6)
    swap.swap_out(5)
    assert kv.allocator.num_free == 8 and kv.num_held(5) == 0 and swap.holds(5)
    assert swap.used_bytes == 3 * 4 * kv.bytes_per_token == 3 * 4 * 2 * 2 * 2 * 3 * 4
    kv.plan([(6, 20, False)])  # another request takes and overwrites the freed pages
    kv.k.zero_()
    kv.v.zero_()
    kv.release(6)
    kv.plan([(7, 4, False)])  # so the swap-in gets other pages than before
    swap.swap_in(5, min_tokens=13)
    assert kv.length(5) == 10 and kv.num_held(5) == 4  # room for the 13-token prefill
    assert torch.equal(context(kv, 5), before) and swap.used_bytes == 0 and not swap.holds(5)


def test_host_budget_bounds_what_is_swapped():
    kv = filled_cache()
    swap = HostSwap(kv, capacity_bytes=2 * 4 * kv.bytes_per_token)  # two pages
    assert swap.fits(8) and not swap.fits(9)
    kv.plan([(1, 5, False)])
    swap.swap_out(1)
    assert not swap.fits(4) and swap.fits(0)
    swap.drop(1)
    assert swap.used_bytes == 0 and swap.fits(8)
