"""The Triton paged prefill attention kernel on a GPU against reference.prefill_attention.

Run on a GPU machine: `python -m pytest -m gpu tests/gpu/test_prefill_attn_gpu.py`. Shapes of
Llama-3-8B (32 query heads, 8 KV heads, d 128) and Llama-3-70B at tp = 8 (8 query heads, 1 KV
head), fresh prompts and chunks continuing a cached prefix, several segments per launch, pages
shuffled. The reference runs in fp32 on the same (rounded) inputs; relative (L2) error ≤ 1e-2
in bf16/fp16, ≤ 1e-4 in fp32. The CUDA-graph test captures one launch and replays it with other
segments of the same bucket (device metadata and block tables rewritten in place).
"""

from __future__ import annotations

import math

import pytest
import torch

from nanosched.kernels import reference as ref
from nanosched.kernels.common import PrefillSegments

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LLAMA8B, LLAMA70B_TP8 = (32, 8, 128), (8, 1, 128)
FRESH = [(0, 2048, 0)]
CONTINUING = [(0, 512, 1536)]  # the last 512 tokens of a 2048-token prompt
MIXED = [(0, 512, 0), (512, 812, 700), (812, 813, 4000), (813, 1500, 0), (1500, 1517, 15)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def block_tables(segments, page: int, num_pages: int, seed: int,
                 rows: int | None = None) -> torch.Tensor:
    """[rows, max pages] int32 over shuffled pages holding every segment's tokens."""
    need = [math.ceil((p + e - s) / page) for s, e, p in segments]
    perm = torch.randperm(num_pages, device="cuda", generator=gen(seed)).int()
    tables = torch.zeros(rows or len(segments), max(need), dtype=torch.int32, device="cuda")
    at = 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[at:at + k]
        at += k
    assert at <= num_pages
    return tables


def inputs(segments, heads, page: int, dtype: torch.dtype, seed: int):
    hq, hkv, d = heads
    num_pages = sum(math.ceil((p + e - s) / page) for s, e, p in segments) + 16
    kc = torch.randn(num_pages, page, hkv, d, device="cuda", generator=gen(seed)).to(dtype)
    vc = torch.randn(num_pages, page, hkv, d, device="cuda", generator=gen(seed + 1)).to(dtype)
    q = torch.randn(segments[-1][1], hq, d, device="cuda", generator=gen(seed + 2)).to(dtype)
    return q, kc, vc, block_tables(segments, page, num_pages, seed + 3)


def reference(q, kc, vc, tables, segments) -> torch.Tensor:
    want = torch.zeros(q.shape, device="cuda")
    ref.prefill_attention(q.float(), kc.float(), vc.float(), tables, segments,
                          q.shape[-1] ** -0.5, want)
    return want


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float16, 1e-2),
                                        (torch.float32, 1e-4)])
@pytest.mark.parametrize("segments", [FRESH, CONTINUING, MIXED], ids=["fresh", "cont", "mixed"])
@pytest.mark.parametrize("heads", [LLAMA8B, LLAMA70B_TP8], ids=["8b", "70b_tp8"])
def test_prefill_attention(heads, segments, dtype, tol):
    from nanosched.kernels.prefill_attn import prefill_attention

    q, kc, vc, tables = inputs(segments, heads, 16, dtype, seed=0)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, kc, vc, tables, segments, q.shape[-1] ** -0.5, out)
    assert rel_err(out, reference(q, kc, vc, tables, segments)) <= tol


@pytest.mark.parametrize("config", [(64, 64, 4, 3), (128, 32, 4, 2), (128, 128, 8, 2),
                                    (64, 32, 4, 2)])
@pytest.mark.parametrize("page, heads", [(16, LLAMA8B), (64, LLAMA8B), (16, (16, 4, 64))])
def test_prefill_attention_tiles_pages_and_head_dim_64(config, page, heads):
    from nanosched.kernels.prefill_attn import PrefillConfig, prefill_attention

    q, kc, vc, tables = inputs(MIXED, heads, page, torch.bfloat16, seed=10)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, kc, vc, tables, MIXED, q.shape[-1] ** -0.5, out,
                      PrefillConfig(*config))
    assert rel_err(out, reference(q, kc, vc, tables, MIXED)) <= 1e-2


def test_dispatch_runs_triton_on_cuda_by_default(monkeypatch):
    from nanosched.kernels import dispatch

    def no_reference(*args, **kwargs):
        raise AssertionError("the torch reference ran")

    q, kc, vc, tables = inputs(CONTINUING, LLAMA8B, 16, torch.bfloat16, seed=20)
    want = reference(q, kc, vc, tables, CONTINUING)
    monkeypatch.setattr(dispatch.ref, "prefill_attention", no_reference)
    out = torch.full_like(q, float("nan"))
    dispatch.prefill_attention(q, kc, vc, tables, CONTINUING, 128 ** -0.5, out,
                               dispatch.KernelOptions())
    assert rel_err(out, want) <= 1e-2


def test_prefill_attention_replays_in_a_cuda_graph_with_new_segments():
    """Capture one launch over a bucket (1,800 rows, 4 segment slots); rewrite the device
    metadata and block tables in place; each replay computes its own segments."""
    from nanosched.kernels.prefill_attn import prefill_attention

    first = [(0, 1024, 0), (1024, 1100, 300)]
    second = [(0, 5, 2000), (5, 700, 0), (700, 1724, 1024), (1724, 1725, 0)]
    num_pages, page, bucket = 512, 16, 4
    hq, hkv, d = LLAMA8B
    kc = torch.randn(num_pages, page, hkv, d, device="cuda", generator=gen(30)).bfloat16()
    vc = torch.randn(num_pages, page, hkv, d, device="cuda", generator=gen(31)).bfloat16()
    q = torch.randn(1800, hq, d, device="cuda", generator=gen(32)).bfloat16()
    width = math.ceil(2048 / page)  # every segment's first_pos + length ≤ 2048
    tables = torch.zeros(bucket, width, dtype=torch.int32, device="cuda")
    meta = PrefillSegments.build(first, "cuda", num_segments=bucket)
    out = torch.empty_like(q)

    def launch() -> None:
        prefill_attention(q, kc, vc, tables, PrefillSegments(meta.table),
                          128 ** -0.5, out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for seed, segments in enumerate((second, first, second)):
        new = block_tables(segments, page, num_pages, seed=40 + seed, rows=bucket)
        tables.zero_()
        tables[:, :new.shape[1]] = new
        meta.write(segments)
        out.fill_(float("nan"))
        graph.replay()
        end = segments[-1][1]
        want = reference(q[:end], kc, vc, tables, segments)
        assert rel_err(out[:end], want) <= 1e-2
        assert out[end:].isnan().all()  # rows no segment covers are not written
