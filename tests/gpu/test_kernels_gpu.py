"""Triton kernels against their torch references on a GPU, at Llama-3-8B shapes.

Run on a GPU machine: `python -m pytest -m gpu tests/gpu`. Tolerance: relative (L2) error
≤ 1e-2 in bf16, ≤ 1e-4 in fp32 (Triton dots in exact fp32, the reference in fp32).
"""

from __future__ import annotations

import math

import pytest
import torch

from nanosched.kernels import reference as ref
from nanosched.models.rope import rope_tables
from nanosched.models.spec import REGISTRY

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = REGISTRY["llama3-8b"]
HQ, HKV, HD, HID, INTER = 32, 8, 128, 4096, 14336
DTYPES = [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)]
PAGE = 16


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, device="cuda", generator=gen(seed)).to(dtype)


def paged_batch(contexts: list[int], seed: int):
    """Block tables [n, max_pages] int32 over shuffled pages, and the number of pages."""
    needed = [math.ceil(c / PAGE) for c in contexts]
    num_pages = sum(needed) + 8
    perm = torch.randperm(num_pages, device="cuda", generator=gen(seed)).int()
    tables = torch.zeros(len(contexts), max(needed), dtype=torch.int32, device="cuda")
    at = 0
    for i, k in enumerate(needed):
        tables[i, :k] = perm[at:at + k]
        at += k
    return tables, num_pages


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("max_ctas, num_splits", [(8, None), (132, None), (None, None),
                                                  (264, 1), (64, 16)])
@pytest.mark.parametrize("config", ["PAGED", "PIPELINED", "PIPELINED_2W"])
def test_decode_attention(dtype, tol, max_ctas, num_splits, config):
    from nanosched.kernels import common
    from nanosched.kernels.decode_attn import decode_attention

    g = torch.Generator().manual_seed(0)
    contexts = [1, 15, 16, 17, 4096] + torch.randint(1, 4097, (59,), generator=g).tolist()
    tables, num_pages = paged_batch(contexts, seed=1)
    kc = randn(num_pages, PAGE, HKV, HD, dtype=dtype, seed=2)
    vc = randn(num_pages, PAGE, HKV, HD, dtype=dtype, seed=3)
    q = randn(len(contexts), HQ, HD, dtype=dtype, seed=4)
    lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    want, got = torch.empty_like(q, dtype=torch.float32), torch.full_like(q, float("nan"))
    ref.decode_attention(q.float(), kc.float(), vc.float(), tables, lens, max(contexts),
                         HD ** -0.5, want)
    decode_attention(q, kc, vc, tables, lens, max(contexts), HD ** -0.5, got,
                     max_ctas=max_ctas, num_splits=num_splits, config=getattr(common, config))
    assert rel_err(got, want) <= tol


def bulk_case(dtype, contexts, seed=0):
    tables, num_pages = paged_batch(contexts, seed=seed + 1)
    kc = randn(num_pages, PAGE, HKV, HD, dtype=dtype, seed=seed + 2)
    vc = randn(num_pages, PAGE, HKV, HD, dtype=dtype, seed=seed + 3)
    q = randn(len(contexts), HQ, HD, dtype=dtype, seed=seed + 4)
    lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    want = torch.empty_like(q, dtype=torch.float32)
    ref.decode_attention(q.float(), kc.float(), vc.float(), tables, lens, max(contexts),
                         HD ** -0.5, want)
    return q, kc, vc, tables, lens, want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_ctas, num_splits", [(8, None), (32, None), (None, None),
                                                  (132, 1), (64, 16), (16, 3)])
def test_cuda_bulk_decode_attention(dtype, max_ctas, num_splits):
    """The bulk-copy kernel against the fp32 reference: partial last pages, a padded row of
    context 0 (zero output), one split (written in the model dtype) and several (merged)."""
    pytest.importorskip("cupy")
    from nanosched.kernels.decode_attn_bulk import decode_attention

    g = torch.Generator().manual_seed(0)
    contexts = [1, 15, 16, 17, 4096, 0] + torch.randint(1, 4097, (58,), generator=g).tolist()
    q, kc, vc, tables, lens, want = bulk_case(dtype, contexts)
    got = torch.full_like(q, float("nan"))
    decode_attention(q, kc, vc, tables, lens, max(contexts), HD ** -0.5, got,
                     max_ctas=max_ctas, num_splits=num_splits)
    assert not got.isnan().any()
    assert got[5].abs().max().item() == 0
    assert rel_err(got, want) <= 1e-2


def test_cuda_bulk_decode_attention_is_captured_in_a_cuda_graph():
    """Replayed from a graph on new context lengths and queries: the new result each time."""
    pytest.importorskip("cupy")
    from nanosched.kernels.decode_attn_bulk import decode_attention

    contexts = [700] * 16 + [2000] * 16
    q, kc, vc, tables, lens, _ = bulk_case(torch.bfloat16, contexts)
    out = torch.empty_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # build outside the capture
        decode_attention(q, kc, vc, tables, lens, 2000, HD ** -0.5, out, max_ctas=32)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, kc, vc, tables, lens, 2000, HD ** -0.5, out, max_ctas=32)
    for seed in (5, 6):
        lens.copy_(torch.randint(1, 2001, (32,), device="cuda", generator=gen(seed)).int())
        q.copy_(randn(32, HQ, HD, dtype=torch.bfloat16, seed=seed))
        want = torch.empty_like(q, dtype=torch.float32)
        ref.decode_attention(q.float(), kc.float(), vc.float(), tables, lens, 2000, HD ** -0.5,
                             want)
        out.fill_(float("nan"))
        graph.replay()
        assert rel_err(out, want) <= 1e-2


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_rms_norm_add(dtype, tol):
    from nanosched.kernels.elementwise import rms_norm_add

    x, r = randn(1024, HID, dtype=dtype, seed=5), randn(1024, HID, dtype=dtype, seed=6)
    w = randn(HID, dtype=dtype, seed=7)
    want, want_r = torch.empty_like(x), torch.empty_like(x)
    ref.rms_norm_add(x, r, w, 1e-5, want, want_r)
    got, r_inplace = torch.empty_like(x), r.clone()
    rms_norm_add(x, r_inplace, w, 1e-5, got, r_inplace)  # residual updated in place
    assert rel_err(got, want) <= tol and rel_err(r_inplace, want_r) <= tol


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_silu_mul(dtype, tol):
    from nanosched.kernels.elementwise import silu_mul

    gu = randn(1024, 2 * INTER, dtype=dtype, seed=8)
    want, got = (torch.empty(1024, INTER, dtype=dtype, device="cuda") for _ in range(2))
    ref.silu_mul(gu, want)
    silu_mul(gu, got)
    assert rel_err(got, want) <= tol


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_rope_append(dtype, tol):
    from nanosched.kernels.elementwise import rope_append

    n, num_pages = 512, 64
    qkv = randn(n, (HQ + 2 * HKV) * HD, dtype=dtype, seed=9)
    pos = torch.randint(0, SPEC.max_position_embeddings, (n,), device="cuda", generator=gen(10))
    slots = torch.randperm(num_pages * PAGE, device="cuda", generator=gen(11))[:n]
    cos, sin = rope_tables(SPEC, "cuda")
    outs = []
    for fn in (ref.rope_append, rope_append):
        k = torch.zeros(num_pages, PAGE, HKV, HD, dtype=dtype, device="cuda")
        v = torch.zeros_like(k)
        q = torch.empty(n, HQ, HD, dtype=dtype, device="cuda")
        fn(qkv, pos, cos, sin, slots, k, v, q)
        outs.append((q, k, v))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert rel_err(got, want) <= tol


@pytest.mark.parametrize("tokens", [128, 1000, 2048])
@pytest.mark.parametrize("num_sms", [None, 100, 32])
@pytest.mark.parametrize("n_out, k_in", [((HQ + 2 * HKV) * HD, HID), (2 * INTER, HID),
                                         (HID, INTER)])
def test_persistent_gemm_bf16(tokens, num_sms, n_out, k_in):
    from nanosched.kernels.gemm import GemmConfig, persistent_linear

    x = randn(tokens, k_in, dtype=torch.bfloat16, seed=12)
    w = randn(n_out, k_in, dtype=torch.bfloat16, seed=13)
    out = torch.empty(tokens, n_out, dtype=torch.bfloat16, device="cuda")
    persistent_linear(x, w, None, out, GemmConfig(num_sms=num_sms))
    assert rel_err(out, x.float() @ w.float().t()) <= 1e-2


def test_persistent_gemm_fp32_with_bias():
    from nanosched.kernels.gemm import GemmConfig, persistent_linear

    x = randn(300, HID, dtype=torch.float32, seed=14)
    w = randn(1024, HID, dtype=torch.float32, seed=15)
    b = randn(1024, dtype=torch.float32, seed=16)
    out = torch.empty(300, 1024, device="cuda")
    persistent_linear(x, w, b, out, GemmConfig(num_sms=66, num_stages=2))
    want = torch.addmm(b.double(), x.double(), w.double().t())
    assert rel_err(out, want) <= 1e-4


# Mixtral-8x7B experts (tp=1): hidden 4096, intermediate 14336, 8 experts, top-2
MOE_D, MOE_I, MOE_E, MOE_K = 4096, 14336, 8, 2


def top2_ids(tokens: int, seed: int) -> torch.Tensor:
    """Expert ids [tokens * 2] of a random top-2 routing (uneven counts), token-major."""
    logits = randn(tokens, MOE_E, dtype=torch.float32, seed=seed)
    return logits.topk(MOE_K, dim=-1).indices.flatten()


@pytest.mark.parametrize("num_programs", [None, 132, 100])
@pytest.mark.parametrize("op", ["gate_up", "down"])
def test_grouped_gemm_bf16_mixtral(op, num_programs):
    from nanosched.kernels.grouped_gemm import GroupedGemmConfig, grouped_linear

    tokens = 1024
    ids = top2_ids(tokens, seed=17)
    if op == "gate_up":  # x [T, D], each token's row read twice (x_rows)
        n_out, k_in, x_rows = 2 * MOE_I, MOE_D, torch.arange(tokens, device="cuda")
        x, x_rows = randn(tokens, k_in, dtype=torch.bfloat16, seed=18), x_rows.repeat_interleave(2)
    else:  # x [T k, I], one row per (token, choice)
        n_out, k_in, x_rows = MOE_D, MOE_I, None
        x = randn(MOE_K * tokens, k_in, dtype=torch.bfloat16, seed=18)
    w = randn(MOE_E, n_out, k_in, dtype=torch.bfloat16, seed=19) * k_in ** -0.5
    want = torch.empty(MOE_K * tokens, n_out, device="cuda")
    ref.grouped_linear(x.float(), w.float(), ids, x_rows, want)
    buf = torch.full((MOE_K * tokens, n_out + 64), float("nan"), dtype=torch.bfloat16,
                     device="cuda")
    out = buf[:, 32:32 + n_out]  # a strided column slice
    grouped_linear(x, w, ids, x_rows, out, GroupedGemmConfig(num_programs=num_programs))
    assert rel_err(out, want) <= 1e-2
    assert buf[:, :32].isnan().all() and buf[:, 32 + n_out:].isnan().all()


def test_grouped_gemm_fp32():
    from nanosched.kernels.grouped_gemm import GroupedGemmConfig, grouped_linear

    ids = top2_ids(300, seed=20)
    x = randn(300, 1024, dtype=torch.float32, seed=21)
    w = randn(MOE_E, 2048, 1024, dtype=torch.float32, seed=22)
    x_rows = torch.arange(300, device="cuda").repeat_interleave(2)
    want = torch.empty(600, 2048, dtype=torch.float64, device="cuda")
    ref.grouped_linear(x.double(), w.double(), ids, x_rows, want)
    out = torch.empty(600, 2048, device="cuda")
    grouped_linear(x, w, ids, x_rows, out, GroupedGemmConfig(num_stages=2))
    assert rel_err(out, want) <= 1e-4


def test_grouped_gemm_is_captured_in_a_cuda_graph():
    """Sort, tile schedule and kernel replay from a graph: new routing, same graph, right rows."""
    from nanosched.kernels import dispatch

    tokens = 256
    x = randn(tokens, MOE_D, dtype=torch.bfloat16, seed=23)
    w = randn(MOE_E, 2 * MOE_I, MOE_D, dtype=torch.bfloat16, seed=24) * MOE_D ** -0.5
    ids = top2_ids(tokens, seed=25)
    x_rows = torch.arange(tokens, device="cuda").repeat_interleave(2)
    out = torch.empty(MOE_K * tokens, 2 * MOE_I, dtype=torch.bfloat16, device="cuda")
    opts, launch = dispatch.KernelOptions(), {"impl": "triton"}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile) outside the capture
        dispatch.grouped_linear(x, w, ids, x_rows, out, opts, launch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dispatch.grouped_linear(x, w, ids, x_rows, out, opts, launch)
    for seed in (26, 27):
        ids.copy_(top2_ids(tokens, seed=seed))
        ids[:MOE_K * 64] = 3  # a crowded expert: its tiles grow, others shrink
        out.fill_(float("nan"))
        graph.replay()
        want = torch.empty(MOE_K * tokens, 2 * MOE_I, device="cuda")
        ref.grouped_linear(x.float(), w.float(), ids, x_rows, want)
        assert rel_err(out, want) <= 1e-2
