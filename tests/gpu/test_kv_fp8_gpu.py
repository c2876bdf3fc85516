"""The FP8 KV cache's kernels on a GPU at Llama-3-8B shapes, against the torch references on the
same e4m3 cache, and the engine with an FP8 cache under CUDA graphs.

Run on a GPU machine: `python -m pytest -m gpu tests/gpu/test_kv_fp8_gpu.py`. The kernels read
the cache exactly as the reference does (relative L2 error ≤ 1e-2 in bf16, the reference in
fp32); the fused rope_append writes the values the reference writes up to the rounding of the
bf16 rotation (the reference rotates in bf16, the kernel in fp32).
"""

from __future__ import annotations

import math

import pytest
import torch

from nanosched.kernels import reference as ref
from nanosched.kernels.common import PAGED, PIPELINED
from nanosched.models.kvcache import KVCache
from nanosched.models.rope import rope_tables
from nanosched.models.spec import REGISTRY

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = REGISTRY["llama3-8b"]
HQ, HKV, HD, PAGE = 32, 8, 128, 16


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def block_tables(pages_per_row: list[int], spare: int, seed: int) -> tuple[torch.Tensor, int]:
    """[rows, max pages] int32 over shuffled pages (`spare` left over) and the page count."""
    num_pages = sum(pages_per_row) + spare
    perm = torch.randperm(num_pages, device="cuda", generator=gen(seed)).int()
    tables = torch.zeros(len(pages_per_row), max(pages_per_row), dtype=torch.int32,
                         device="cuda")
    at = 0
    for i, k in enumerate(pages_per_row):
        tables[i, :k] = perm[at:at + k]
        at += k
    return tables, num_pages


def fp8_pages(num_pages: int, seed: int):
    k = torch.randn(num_pages, PAGE, HKV, HD, device="cuda", generator=gen(seed)) * 2
    v = torch.randn(num_pages, PAGE, HKV, HD, device="cuda", generator=gen(seed + 1))
    return (*ref.quantize_fp8(k), *ref.quantize_fp8(v))  # kc, ks, vc, vs


def test_rope_append_writes_the_reference_fp8_cache():
    from nanosched.kernels.elementwise import rope_append

    n, num_pages = 512, 64
    qkv = torch.randn(n, (HQ + 2 * HKV) * HD, device="cuda", generator=gen(1)).bfloat16()
    pos = torch.randint(0, SPEC.max_position_embeddings, (n,), device="cuda", generator=gen(2))
    slots = torch.randperm(num_pages * PAGE, device="cuda", generator=gen(3))[:n]
    cos, sin = rope_tables(SPEC, "cuda")
    caches = []
    for fn, kv_dtype in ((ref.rope_append, "auto"), (ref.rope_append, "fp8"),
                         (rope_append, "fp8")):
        kv = KVCache(1, num_pages, HKV, HD, torch.bfloat16, "cuda", PAGE, kv_dtype=kv_dtype)
        layer = kv.layer(0)
        fn(qkv, pos, cos, sin, slots, layer.k, layer.v,
           torch.empty(n, HQ, HD, dtype=torch.bfloat16, device="cuda"), **layer.scales)
        caches.append(kv)
    plain, want, got = caches
    assert torch.equal(got.v_scale, want.v_scale)  # V is copied: the same amax
    assert rel_err(got.k_scale, want.k_scale) < 1e-2  # K: rotated in bf16 vs in fp32
    # e4m3 keeps each value within 2^-4 of itself: about 2% RMS against the bf16 cache
    for cache in (want, got):
        for q8, scale, exact in ((cache.k, cache.k_scale, plain.k), (cache.v, cache.v_scale,
                                                                     plain.v)):
            err = rel_err(ref.dequantize(q8, scale), exact)
            print(f"{'kernel' if cache is got else 'reference'}: {err:.4f}")
            assert err < 0.03


def decode_case(dtype=torch.bfloat16):
    """64 requests of contexts 0 to 4,096 (partial last pages; row 5 a padded row of context 0)
    on a shuffled e4m3 cache, and the reference's output on that same cache."""
    g = torch.Generator().manual_seed(0)
    contexts = [1, 15, 16, 17, 4096, 0] + torch.randint(1, 4097, (58,), generator=g).tolist()
    tables, num_pages = block_tables([max(1, math.ceil(c / PAGE)) for c in contexts], 8, 4)
    kc, ks, vc, vs = fp8_pages(num_pages, seed=5)
    q = torch.randn(len(contexts), HQ, HD, device="cuda", generator=gen(7)).to(dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    want = torch.empty(q.shape, device="cuda")
    ref.decode_attention(q.float(), kc, vc, tables, lens, max(contexts), HD ** -0.5, want,
                         k_scale=ks, v_scale=vs)
    args = (q, kc, vc, tables, lens, max(contexts), HD ** -0.5)
    return args, {"k_scale": ks, "v_scale": vs}, want


def check_decode(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not got.isnan().any()
    assert torch.equal(got[5], torch.zeros_like(got[5]))  # context 0: zero, no NaN
    assert rel_err(got, want) <= 1e-2


@pytest.mark.parametrize("max_ctas, num_splits", [(64, None), (None, None), (264, 1)])
@pytest.mark.parametrize("config", [PAGED, PIPELINED])
def test_decode_attention_on_fp8_cache(max_ctas, num_splits, config):
    from nanosched.kernels.decode_attn import decode_attention

    args, scales, want = decode_case()
    got = torch.full_like(args[0], float("nan"))
    decode_attention(*args, got, max_ctas=max_ctas, num_splits=num_splits, config=config,
                     **scales)
    check_decode(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_ctas, num_splits", [(16, None), (32, None), (None, None),
                                                  (132, 1), (64, 16)])
def test_cuda_bulk_decode_attention_on_fp8_cache(dtype, max_ctas, num_splits):
    """`cuda_bulk` on an e4m3 cache (its K/V and scales through the ring, the products in fp16)
    against the reference on the same cache, one split (written in the model dtype) and
    several (merged)."""
    pytest.importorskip("cupy")
    from nanosched.kernels import decode_attn_bulk

    args, scales, want = decode_case(dtype)
    got = torch.full_like(args[0], float("nan"))
    decode_attn_bulk.decode_attention(*args, got, max_ctas=max_ctas, num_splits=num_splits,
                                      **scales)
    check_decode(got, want)


def test_cuda_bulk_on_fp8_cache_is_captured_in_a_cuda_graph():
    """Replayed from a graph on new context lengths and queries: the new result each time."""
    pytest.importorskip("cupy")
    from nanosched.kernels.decode_attn_bulk import decode_attention

    contexts = [700] * 16 + [2000] * 16
    tables, num_pages = block_tables([math.ceil(c / PAGE) for c in contexts], 8, 4)
    kc, ks, vc, vs = fp8_pages(num_pages, seed=5)
    q = torch.randn(32, HQ, HD, device="cuda", generator=gen(7)).bfloat16()
    lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # build outside the capture
        decode_attention(q, kc, vc, tables, lens, 2000, HD ** -0.5, out, max_ctas=32,
                         k_scale=ks, v_scale=vs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, kc, vc, tables, lens, 2000, HD ** -0.5, out, max_ctas=32,
                         k_scale=ks, v_scale=vs)
    for seed in (5, 6):
        lens.copy_(torch.randint(1, 2001, (32,), device="cuda", generator=gen(seed)).int())
        q.copy_(torch.randn(32, HQ, HD, device="cuda", generator=gen(seed + 10)).bfloat16())
        want = torch.empty(q.shape, device="cuda")
        ref.decode_attention(q.float(), kc, vc, tables, lens, 2000, HD ** -0.5, want,
                             k_scale=ks, v_scale=vs)
        out.fill_(float("nan"))
        graph.replay()
        assert rel_err(out, want) <= 1e-2


@pytest.mark.parametrize("segments", [[(0, 2048, 0)], [(0, 512, 1536)],
                                      [(0, 512, 0), (512, 812, 700), (812, 813, 4000)]])
def test_prefill_attention_on_fp8_cache(segments):
    from nanosched.kernels.prefill_attn import prefill_attention

    tables, num_pages = block_tables([math.ceil((p + e - s) / PAGE) for s, e, p in segments],
                                     16, 8)
    kc, ks, vc, vs = fp8_pages(num_pages, seed=9)
    q = torch.randn(segments[-1][1], HQ, HD, device="cuda", generator=gen(11)).bfloat16()
    want, got = torch.zeros(q.shape, device="cuda"), torch.full_like(q, float("nan"))
    ref.prefill_attention(q.float(), kc, vc, tables, segments, HD ** -0.5, want, k_scale=ks,
                          v_scale=vs)
    prefill_attention(q, kc, vc, tables, segments, HD ** -0.5, got, k_scale=ks, v_scale=vs)
    assert rel_err(got, want) <= 1e-2


def test_engine_with_fp8_cache_and_graphs_matches_eager():
    """Greedy tokens of a 2-layer random Llama-3-8B with an FP8 cache: the engine with CUDA
    graphs gives the tokens of the eager engine laying batches out the same way."""
    from runtime_helpers import serve_all

    from nanosched.models.model import CausalLM
    from nanosched.models.weights import init_random
    from nanosched.runtime.requests import make_requests

    spec = SPEC.__class__(**{**SPEC.to_json(), "num_layers": 2, "name": "llama3-8b-2l"})
    model = CausalLM(spec, dtype=torch.bfloat16, device="cuda")
    init_random(model, seed=0)
    outs = []
    for graphs in ("layout", "on"):
        reqs = make_requests("sharegpt", None, None, 64, spec.vocab_size, 2048, seed=5)
        ids, eng = serve_all(model, reqs, 8192, dense_batch=512, graphs=graphs, graph_align=32,
                             kv_dtype="fp8")
        assert eng.ws.kv.k.dtype == torch.float8_e4m3fn
        outs.append(ids)
    assert outs[0] == outs[1]
