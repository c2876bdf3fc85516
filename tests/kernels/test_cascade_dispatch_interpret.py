"""The model's attn_decode with `--decode-attention cascade`, on CPU through TRITON_INTERPRET=1
(set by tests/conftest.py without a GPU): on a batch whose decode rows share prefix pages it
runs kernels/cascade_attn.py through dispatch, eager (`BatchMeta`) and in a frozen graph
bucket (`BucketMeta`), bf16-free (fp32 model) and on an FP8 cache, and matches the default
decode attention; a batch without a shared page, or a nano-batch without every decode row,
runs the default one."""

from __future__ import annotations

import os

import pytest
import torch
from runtime_helpers import tiny_engine_model

from nanosched.kernels import cascade_attn
from nanosched.kernels import reference as ref
from nanosched.kernels.dispatch import KernelOptions, triton_available
from nanosched.models.batch import BatchMeta, SeqChunk
from nanosched.models.bucket import Bucket, BucketMeta
from nanosched.models.op_impls import attn_decode

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="needs triton and TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")

PAGE = 4


def decode(table, ctx):
    return SeqChunk(tuple(table), ctx - 1, 1, True)


# five rows on pages 1-3 (one whose context is exactly those pages), three on 10-11, one alone,
# then a prompt chunk
SHARED = [decode((1, 2, 3, 20), 13), decode((1, 2, 3, 21, 22), 19), decode((1, 2, 3), 12),
          decode((1, 2, 3, 23), 16), decode((1, 2, 3, 24, 25), 18),
          decode((10, 11, 30), 9), decode((10, 11, 31, 32), 14), decode((10, 11, 33), 12),
          decode((40, 41), 7), SeqChunk((50, 51), 0, 6, False)]
LONELY = [decode((1, 2, 3), 12), decode((10, 11), 7), SeqChunk((50, 51), 0, 6, False)]


def workspace(model, kv_dtype):
    ws = model.new_workspace(32, 64, page_size=PAGE, kv_dtype=kv_dtype)
    gen = torch.Generator().manual_seed(1)
    layer = ws.kv.layer(0)
    k = torch.randn(layer.k.shape, generator=gen)
    v = torch.randn(layer.v.shape, generator=gen)
    if kv_dtype == "fp8":
        (k8, ks), (v8, vs) = ref.quantize_fp8(k * 2), ref.quantize_fp8(v)
        layer.k.copy_(k8), layer.v.copy_(v8), layer.k_scale.copy_(ks), layer.v_scale.copy_(vs)
    else:
        layer.k.copy_(k), layer.v.copy_(v)
    ws.q.copy_(torch.randn(ws.q.shape, generator=gen))
    return ws


def meta_of(chunks, graph):
    if not graph:
        return BatchMeta.build(chunks, PAGE, cascade=True)
    meta = BucketMeta(Bucket(16, 32, 4, 8), PAGE, scratch_slot=0, device="cpu", cascade=True)
    meta.slice(0, 4)
    meta.write(chunks)
    meta.freeze()
    meta.write(chunks)  # through the packed buffer, as a replay's
    return meta


def attend(model, ws, meta, opts, end=None):
    model.kernels = opts
    ws.attn.fill_(float("nan"))
    attn_decode(model, 0, ws, meta, 0, meta.end if end is None else end, None)
    return ws.attn[:meta.num_decode if end is None else end].clone()


@pytest.fixture
def calls(monkeypatch):
    seen = []
    real = cascade_attn.cascade_decode_attention

    def spy(*args, **kwargs):
        seen.append(args[8])
        return real(*args, **kwargs)

    monkeypatch.setattr(cascade_attn, "cascade_decode_attention", spy)
    return seen


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "bucket"])
def test_attn_decode_runs_cascade_on_shared_pages_and_matches_the_default(kv_dtype, graph,
                                                                           calls):
    model = tiny_engine_model()
    ws = workspace(model, kv_dtype)
    meta = meta_of(SHARED, graph)
    nd = sum(c.is_decode for c in SHARED)
    want = attend(model, ws, meta, KernelOptions("triton"))[:nd]
    got = attend(model, ws, meta, KernelOptions("triton", decode_impl="cascade"))[:nd]
    assert len(calls) == 1 and calls[0].prefix_lens.tolist()[:3] == [8, 8, 0]
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a nano-batch without every decode row runs the default kernel
    part = attend(model, ws, meta, KernelOptions("triton", decode_impl="cascade"), end=4)
    assert len(calls) == 1
    torch.testing.assert_close(part, want[:4], rtol=1e-5, atol=1e-5)


def test_attn_decode_without_a_shared_page_runs_the_default(calls):
    model = tiny_engine_model()
    ws = workspace(model, "auto")
    meta = meta_of(LONELY, False)
    assert meta.cascade_groups() is None
    want = attend(model, ws, meta, KernelOptions("triton"))
    got = attend(model, ws, meta, KernelOptions("triton", decode_impl="cascade"))
    assert not calls
    torch.testing.assert_close(got, want, rtol=0, atol=0)
