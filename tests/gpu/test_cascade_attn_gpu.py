"""GPU: cascade decode attention against decode attention at Llama-3-8B shapes (Hq 32, Hkv 8,
d 128, page 16), on a bf16 and an e4m3 cache, eager and replayed from a CUDA graph.

Both the fp32 reference (`reference.decode_attention`) and the engine's Triton kernel
(`decode_attn.decode_attention`) read each row's full block table. The cascade kernel gets
tables whose shared prefix entries past a group's first row point at a decoy page of huge
values, so reading them there (instead of once from the first row) shows in the output. The
rows' own tokens are read by the Triton partial kernel or by cuda_bulk (`suffix_impl`).
"""

from __future__ import annotations

import math

import pytest
import torch

from nanosched.kernels import reference as ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HQ, HKV, HD, PAGE = 32, 8, 128, 16
# (prefix pages, contexts): 100 rows on a 2,000-token prefix with 1-328 own tokens (tiles of
# rows), a row whose context is exactly its prefix, a group of one row on an odd prefix, rows
# sharing nothing (one of them a padded row of context 0)
GROUPS = [(125, [2000 + 1 + (37 * i) % 328 for i in range(99)] + [2000]), (3, [50]),
          (0, [1, 0, 700, 16])]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def make_case(kv_dtype: str, seed: int = 0):
    """q (bf16), the cache (+ scales), real and decoyed block tables, context lengths."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_of = [[max(0, math.ceil(c / PAGE) - p) for c in ctxs] for p, ctxs in GROUPS]
    num_pages = 1 + sum(p + sum(own) for (p, _), own in zip(GROUPS, pages_of, strict=True))
    perm = iter(torch.randperm(num_pages - 1, device="cuda", generator=g).add(1).tolist())
    contexts = [c for _, ctxs in GROUPS for c in ctxs]
    width = max(math.ceil(c / PAGE) for c in contexts)
    tables = torch.zeros(len(contexts), width, dtype=torch.int32)
    decoyed = tables.clone()  # page 0 is the decoy
    row = 0
    for (p, _), own in zip(GROUPS, pages_of, strict=True):
        shared = [next(perm) for _ in range(p)]
        for i, k in enumerate(own):
            tables[row, :p + k] = torch.tensor(shared + [next(perm) for _ in range(k)])
            decoyed[row] = tables[row]
            if i > 0:
                decoyed[row, :p] = 0
            row += 1
    k = torch.randn(num_pages, PAGE, HKV, HD, device="cuda", generator=g)
    v = torch.randn(num_pages, PAGE, HKV, HD, device="cuda", generator=g)
    k[0], v[0] = 1e3, 1e3  # the decoy: a row that reads it is far off
    if kv_dtype == "fp8":
        (kc, ks), (vc, vs) = ref.quantize_fp8(k), ref.quantize_fp8(v)
        scales = {"k_scale": ks, "v_scale": vs}
    else:
        kc, vc, scales = k.bfloat16(), v.bfloat16(), {}
    q = torch.randn(len(contexts), HQ, HD, device="cuda", generator=g).bfloat16()
    lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    return q, kc, vc, tables.cuda(), decoyed.cuda(), lens, scales


def groups_meta():
    from nanosched.kernels.cascade_attn import CascadeGroups

    return CascadeGroups.build([len(c) for _, c in GROUPS], [p * PAGE for p, _ in GROUPS],
                               PAGE, "cuda", num_groups=5)  # two empty padding groups


def want_outputs(q, kc, vc, tables, lens, scales):
    """The fp32 reference and the engine's Triton decode attention, both over full tables."""
    from nanosched.kernels.decode_attn import decode_attention

    max_len = int(lens.max())
    want = torch.empty(q.shape, device="cuda")
    ref.decode_attention(q.float(), kc, vc, tables, lens, max_len, HD ** -0.5, want, **scales)
    engine = torch.empty_like(q)
    decode_attention(q, kc, vc, tables, lens, max_len, HD ** -0.5, engine, **scales)
    return want, engine


@pytest.mark.parametrize("suffix_impl", ["triton", "cuda_bulk"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("max_ctas, prefix_splits, suffix_splits",
                         [(None, None, None), (64, 1, 1), (528, 4, 3)])
def test_cascade_matches_decode_attention(kv_dtype, max_ctas, prefix_splits, suffix_splits,
                                          suffix_impl):
    from nanosched.kernels.cascade_attn import cascade_decode_attention

    q, kc, vc, tables, decoyed, lens, scales = make_case(kv_dtype)
    want, engine = want_outputs(q, kc, vc, tables, lens, scales)
    got = torch.full_like(q, float("nan"))
    cascade_decode_attention(q, kc, vc, decoyed, lens, int(lens.max()), HD ** -0.5, got,
                             groups_meta(), max_suffix_len=700, max_ctas=max_ctas,
                             prefix_splits=prefix_splits, suffix_splits=suffix_splits,
                             suffix_impl=suffix_impl, **scales)
    torch.cuda.synchronize()
    assert not got.isnan().any()
    assert torch.equal(got[-3], torch.zeros_like(got[-3]))  # the padded row
    err, engine_err = rel_err(got, want), rel_err(engine, want)
    print(f"{kv_dtype} {suffix_impl}: cascade {err:.2e}, decode_attention {engine_err:.2e}")
    assert err < 1e-2 and rel_err(got, engine) < 1e-2


@pytest.mark.parametrize("suffix_impl", ["triton", "cuda_bulk"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_cascade_in_a_cuda_graph(kv_dtype, suffix_impl):
    """Captured once, replayed on new queries: the same output as an eager call."""
    from nanosched.kernels.cascade_attn import cascade_decode_attention
    from nanosched.profiler.timing import captured

    q, kc, vc, tables, decoyed, lens, scales = make_case(kv_dtype, seed=1)
    meta, out, max_len = groups_meta(), torch.empty_like(q), int(lens.max())

    def call() -> None:
        cascade_decode_attention(q, kc, vc, decoyed, lens, max_len, HD ** -0.5, out, meta,
                                 max_suffix_len=700, suffix_impl=suffix_impl, **scales)

    graph = captured(call, torch.cuda.Stream())  # one eager call, then the capture
    q.copy_(torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda")
                        .manual_seed(9)).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    want, _ = want_outputs(q, kc, vc, tables, lens, scales)
    assert rel_err(out, want) < 1e-2
