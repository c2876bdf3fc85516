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
def test_decode_attention(dtype, tol, max_ctas, num_splits):
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
                     max_ctas=max_ctas, num_splits=num_splits)
    assert rel_err(got, want) <= tol


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
