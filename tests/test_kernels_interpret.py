"""Every Triton kernel against its torch reference, on CPU through TRITON_INTERPRET=1.

Small shapes, fp32 and fp16 only (bf16 loads give garbage in the interpreter). tests/conftest.py
sets TRITON_INTERPRET=1 on machines without a GPU; with a GPU these are covered by tests/gpu/.
"""

from __future__ import annotations

import os

import pytest
import torch
from hf_models import make_hf

from nanosched.kernels import reference as ref
from nanosched.kernels.dispatch import KernelOptions, triton_available

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="needs triton and TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")

DTYPES = [torch.float32, torch.float16]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_ctas, num_splits", [(3, None), (2, 1), (16, 3)])
def test_decode_attention(dtype, max_ctas, num_splits):
    from nanosched.kernels.decode_attn import decode_attention

    gen = torch.Generator().manual_seed(0)
    pages, page, hkv, group, d = 24, 16, 2, 4, 32
    kc = torch.randn(pages, page, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(pages, page, hkv, d, generator=gen).to(dtype)
    lens = torch.tensor([1, 17, 100, 64, 33], dtype=torch.int32)
    tables = torch.stack([torch.randperm(pages, generator=gen)[:7] for _ in lens]).int()
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype)
    want, got = torch.empty_like(q), torch.full_like(q, float("nan"))
    ref.decode_attention(q, kc, vc, tables, lens, 100, d ** -0.5, want)
    decode_attention(q, kc, vc, tables, lens, 100, d ** -0.5, got, max_ctas=max_ctas,
                     num_splits=num_splits)
    assert rel_err(got, want) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_add(dtype, with_residual):
    from nanosched.kernels.elementwise import rms_norm_add

    gen = torch.Generator().manual_seed(1)
    x, r = (torch.randn(5, 48, generator=gen).to(dtype) for _ in range(2))
    w = torch.rand(48, generator=gen).to(dtype) + 0.5
    res = r if with_residual else None
    want, want_r = torch.empty_like(x), torch.empty_like(x)
    got, got_r = torch.empty_like(x), torch.empty_like(x)
    ref.rms_norm_add(x, res, w, 1e-5, want, want_r)
    rms_norm_add(x, res, w, 1e-5, got, got_r)
    assert rel_err(got, want) < tol(dtype) and rel_err(got_r, want_r) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    from nanosched.kernels.elementwise import silu_mul

    gu = torch.randn(6, 2 * 40, generator=torch.Generator().manual_seed(2)).to(dtype)
    want, got = torch.empty(6, 40, dtype=dtype), torch.empty(6, 40, dtype=dtype)
    ref.silu_mul(gu, want)
    silu_mul(gu, got)
    assert rel_err(got, want) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_append(dtype):
    from nanosched.kernels.elementwise import rope_append

    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, pages, page = 4, 2, 16, 6, 4
    qkv = torch.randn(5, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    pos, slots = torch.tensor([0, 3, 7, 100, 5]), torch.tensor([1, 9, 23, 3, 12])
    freqs = torch.outer(torch.arange(128).float(), 1 / 500.0 ** (torch.arange(0, d, 2) / d))
    outs = []
    for fn in (ref.rope_append, rope_append):
        k, v = torch.zeros(pages, page, hkv, d, dtype=dtype), torch.zeros(pages, page, hkv, d,
                                                                         dtype=dtype)
        q = torch.empty(5, hq, d, dtype=dtype)
        fn(qkv, pos, freqs.cos(), freqs.sin(), slots, k, v, q)
        outs.append((q, k, v))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert rel_err(got, want) < tol(dtype)
    assert outs[1][2].view(-1, hkv, d)[9].abs().sum() > 0  # V written at token 1's slot


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_sms, bias", [(1, False), (3, True)])
def test_persistent_gemm(dtype, num_sms, bias):
    from nanosched.kernels.gemm import GemmConfig, persistent_linear

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, 50, generator=gen).to(dtype)
    w = torch.randn(70, 50, generator=gen).to(dtype)
    b = torch.randn(70, generator=gen).to(dtype) if bias else None
    want = x.float() @ w.float().t() + (b.float() if bias else 0)
    out = torch.empty(40, 70, dtype=dtype)[2:39]  # a row slice of a larger buffer
    cfg = GemmConfig(num_sms=num_sms, block_m=16, block_n=32, block_k=16, group_m=2)
    persistent_linear(x, w, b, out, cfg)
    assert rel_err(out, want) < tol(dtype)


def test_model_on_triton_kernels_matches_torch(tmp_path):
    """The whole tiny model through the Triton kernels (interpreted) equals the torch path."""
    from nanosched.models.checkpoint import load_checkpoint
    from nanosched.models.model import CausalLM
    from nanosched.models.spec import load_spec

    make_hf("llama", tmp_path, seed=5, num_hidden_layers=1)
    logits = []
    for opts in (KernelOptions("torch"), KernelOptions("triton", gemm="triton")):
        model = CausalLM(load_spec(str(tmp_path)), kernels=opts)
        load_checkpoint(model, tmp_path)
        ws = model.new_workspace(16, 6)
        ws.kv.plan([(0, 6, False)])
        meta = ws.kv.plan([(0, 1, True), (1, 9, False)])
        ws.kv.k.normal_(generator=torch.Generator().manual_seed(6))  # request 0's context
        ws.token_ids[:10] = torch.arange(10) * 3
        with torch.inference_mode():
            logits.append(model(ws, meta))
    assert rel_err(logits[1], logits[0]) < 1e-5
