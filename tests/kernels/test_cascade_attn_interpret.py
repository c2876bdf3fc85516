"""Cascade decode attention against `reference.decode_attention` over the rows' whole contexts,
on CPU through TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU), fp32 and fp16.

The kernel gets block tables whose shared prefix pages are poisoned past each group's first row
(an index that faults if read): the suffix kernel must start at the prefix, and the prefix
kernel must read the group's first row only.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from nanosched.errors import ConfigError
from nanosched.kernels import reference as ref
from nanosched.kernels.common import PAGED, PIPELINED
from nanosched.kernels.dispatch import triton_available

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="needs triton and TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")

PAGE, HKV, GQA, D = 16, 2, 4, 32
POISON = 10 ** 6  # a page id far past the cache
# (prefix pages, contexts of its rows): 7 rows on an odd prefix of 3 pages, one of them
# exactly the prefix (an empty suffix); a group of one row; rows that share nothing, one of
# them a padded row of context 0
GROUPS = [(3, [48, 49, 60, 100, 77, 48, 90]), (1, [40]), (0, [33, 0, 17])]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def make_case(groups, dtype=torch.float32, seed=0, fp8=False):
    """Cache, real block tables, poisoned block tables, context lengths, q, and the
    reference's output over the real tables."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(p + sum(max(0, math.ceil(c / PAGE) - p) for c in ctxs) for p, ctxs in groups)
    num_pages = need + 3
    perm = iter(torch.randperm(num_pages, generator=gen).tolist())
    contexts = [c for _, ctxs in groups for c in ctxs]
    width = max(math.ceil(c / PAGE) for c in contexts)
    tables = torch.zeros(len(contexts), width, dtype=torch.int32)
    poisoned = tables.clone()
    row = 0
    for p, ctxs in groups:
        shared = [next(perm) for _ in range(p)]
        for i, c in enumerate(ctxs):
            own = [next(perm) for _ in range(max(0, math.ceil(c / PAGE) - p))]
            tables[row, :p + len(own)] = torch.tensor(shared + own, dtype=torch.int32)
            poisoned[row] = tables[row]
            if i > 0:
                poisoned[row, :p] = POISON
            if c == 0:
                poisoned[row] = POISON
            row += 1
    kc = torch.randn(num_pages, PAGE, HKV, D, generator=gen)
    vc = torch.randn(num_pages, PAGE, HKV, D, generator=gen)
    scales = {}
    if fp8:
        kc, ks = ref.quantize_fp8(kc * 2)
        vc, vs = ref.quantize_fp8(vc)
        scales = {"k_scale": ks, "v_scale": vs}
    else:
        kc, vc = kc.to(dtype), vc.to(dtype)
    lens = torch.tensor(contexts, dtype=torch.int32)
    q = torch.randn(len(contexts), HKV * GQA, D, generator=gen).to(dtype)
    want = torch.empty_like(q)
    ref.decode_attention(q, kc, vc, tables, lens, max(contexts), D ** -0.5, want, **scales)
    return kc, vc, poisoned, lens, q, want, scales


def run(groups, case, **kwargs):
    from nanosched.kernels.cascade_attn import CascadeGroups, cascade_decode_attention

    kc, vc, tables, lens, q, _, scales = case
    meta = CascadeGroups.build([len(c) for _, c in groups], [p * PAGE for p, _ in groups],
                               PAGE, "cpu", num_groups=kwargs.pop("num_groups", None))
    got = torch.full_like(q, float("nan"))
    cascade_decode_attention(q, kc, vc, tables, lens, int(lens.max()), D ** -0.5, got, meta,
                             **kwargs, **scales)
    return got


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("max_ctas, prefix_splits, suffix_splits",
                         [(3, None, None), (2, 1, 1), (16, 3, 2)])
def test_matches_decode_attention(dtype, tol, max_ctas, prefix_splits, suffix_splits):
    from nanosched.kernels.cascade_attn import PrefixConfig

    case = make_case(GROUPS, dtype)
    # tiles of 4 rows (16 = 4 rows x 4 query heads): the 7-row group takes two
    got = run(GROUPS, case, max_ctas=max_ctas, prefix_splits=prefix_splits,
              suffix_splits=suffix_splits, prefix=PrefixConfig(block_m=16, block_n=16))
    want = case[5]
    assert not got.isnan().any()
    assert torch.all(got[9] == 0)  # the padded row
    assert rel_err(got, want) < tol


@pytest.mark.parametrize("config", [PAGED, PIPELINED])
def test_one_tile_per_group_and_suffix_configs(config):
    """The default prefix tile (64 = 16 rows), each suffix DecodeConfig, a padding group
    (empty) at the end of fixed-size metadata, and 5 prefix splits of one 80-token prefix."""
    from nanosched.kernels.cascade_attn import PrefixConfig

    groups = [(5, [80, 95, 130]), (2, [40, 32])]
    case = make_case(groups, seed=1)
    got = run(groups, case, max_ctas=4, prefix_splits=5, config=config, num_groups=4,
              prefix=PrefixConfig(block_n=16))
    assert rel_err(got, case[5]) < 1e-5


def test_every_row_alone_is_decode_attention():
    """One group of prefix 0 holding every row: the cascade is plain decode attention."""
    groups = [(0, [1, 17, 100, 64])]
    case = make_case(groups, seed=2)
    assert rel_err(run(groups, case, max_ctas=3), case[5]) < 1e-5


def test_fp8_cache_with_scales():
    """An e4m3 cache with per-(token, KV head) scales, fp32 queries: to fp32 rounding of the
    reference on the same e4m3 values."""
    case = make_case(GROUPS, fp8=True, seed=3)
    from nanosched.kernels.cascade_attn import PrefixConfig

    got = run(GROUPS, case, max_ctas=4, prefix_splits=2, prefix=PrefixConfig(block_m=16,
                                                                              block_n=16))
    assert rel_err(got, case[5]) < 1e-5


def test_launches_apart_give_the_whole_call():
    """`cascade_launches`: prefix, then suffix run again on its starts, then merge, each called
    apart (as a benchmark times them), give what one call gives; no rows, no launches."""
    from nanosched.kernels.cascade_attn import CascadeGroups, PrefixConfig, cascade_launches

    kc, vc, tables, lens, q, want, _ = make_case(GROUPS, seed=4)
    meta = CascadeGroups.build([len(c) for _, c in GROUPS], [p * PAGE for p, _ in GROUPS],
                               PAGE, "cpu")
    got = torch.full_like(q, float("nan"))
    launches = cascade_launches(q, kc, vc, tables, lens, int(lens.max()), D ** -0.5, got, meta,
                                max_ctas=3, prefix=PrefixConfig(block_m=16, block_n=16))
    launches.prefix()
    launches.suffix()
    launches.suffix()
    assert got.isnan().all()  # only the merge writes out
    launches.merge()
    assert launches.plan.num_tiles == 2 and rel_err(got, want) < 1e-5
    assert cascade_launches(q[:0], kc, vc, tables[:0], lens[:0], 1, D ** -0.5, got[:0],
                            CascadeGroups.build([0], [0], PAGE, "cpu")) is None


def torch_bulk_partials(q, k_cache, v_cache, block_tables, context_lens, max_context_len,
                        scale, part, lse, *, k_scale=None, v_scale=None):
    """decode_attn_bulk.decode_partials' contract in torch: each row's context in part.shape[2]
    splits of `partial_pages` pages, each normalised, with its natural-log LSE (an empty split:
    zeros and -inf)."""
    from nanosched.kernels.decode_attn_bulk import partial_pages

    splits = part.shape[2]
    step = partial_pages(max_context_len, splits) * PAGE
    group = q.shape[1] // k_cache.shape[2]
    for i, length in enumerate(context_lens.tolist()):
        tok = torch.arange(length)
        pages = block_tables[i, tok // PAGE].long()
        k = ref.dequantize(k_cache[pages, tok % PAGE], None if k_scale is None
                           else k_scale[pages, tok % PAGE])  # [T, Hkv, d]
        v = ref.dequantize(v_cache[pages, tok % PAGE], None if v_scale is None
                           else v_scale[pages, tok % PAGE])
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [T, Hq, d]
        scores = torch.einsum("hd,thd->ht", q[i].float(), k) * scale  # [Hq, T]
        for j in range(splits):
            lo, hi = j * step, min((j + 1) * step, length)
            if hi <= lo:
                part[i, :, j], lse[i, :, j] = 0.0, float("-inf")
                continue
            w = torch.softmax(scores[:, lo:hi], dim=1)
            part[i, :, j] = torch.einsum("ht,thd->hd", w, v[lo:hi])
            lse[i, :, j] = torch.logsumexp(scores[:, lo:hi], dim=1)


@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_bulk_suffix_reads_each_row_past_its_prefix(fp8, monkeypatch):
    """suffix_impl "cuda_bulk": the prefix partials merge with the bulk kernel's two splits of
    each row's own tokens, read through its block table shifted past its prefix (here the
    bulk kernel's contract in torch: no GPU); poisoned prefix pages are never read."""
    from nanosched.kernels import decode_attn_bulk
    from nanosched.kernels.cascade_attn import CascadeGroups, PrefixConfig, cascade_launches

    monkeypatch.setattr(decode_attn_bulk, "missing_dependency", lambda: None)
    monkeypatch.setattr(decode_attn_bulk, "unsupported", lambda *a, **k: None)
    monkeypatch.setattr(decode_attn_bulk, "decode_partials", torch_bulk_partials)
    kc, vc, tables, lens, q, want, scales = make_case(GROUPS, fp8=fp8, seed=5)
    meta = CascadeGroups.build([len(c) for _, c in GROUPS], [p * PAGE for p, _ in GROUPS],
                               PAGE, "cpu", num_groups=4)
    got = torch.full_like(q, float("nan"))
    launches = cascade_launches(q, kc, vc, tables, lens, int(lens.max()), D ** -0.5, got, meta,
                                max_ctas=3, prefix=PrefixConfig(block_m=16, block_n=16),
                                suffix_impl="cuda_bulk", **scales)
    launches()
    assert launches.plan.s_splits == 2 and torch.all(got[9] == 0)
    assert rel_err(got, want) < 1e-5
    with pytest.raises(ConfigError, match="suffix_impl 'bulk' is not one of"):
        cascade_launches(q, kc, vc, tables, lens, int(lens.max()), D ** -0.5, got, meta,
                         suffix_impl="bulk")


def test_cuda_bulk_suffix_says_why_it_cannot_run():
    from nanosched.kernels.cascade_attn import CascadeGroups, cascade_launches

    kc, vc, tables, lens, q, _, _ = make_case([(1, [20, 30])])
    meta = CascadeGroups.build([2], [16], PAGE, "cpu")
    with pytest.raises(ConfigError, match="the cuda_bulk suffix cannot run: .*(installed|q)"):
        cascade_launches(q, kc, vc, tables, lens, 30, D ** -0.5, torch.empty_like(q), meta,
                         suffix_impl="cuda_bulk")


def test_builder_refuses_bad_groups():
    from nanosched.kernels.cascade_attn import CascadeGroups

    with pytest.raises(ConfigError, match="cascade group 1: rows 2, prefix_len 20"):
        CascadeGroups.build([3, 2], [32, 20], PAGE, "cpu")
    with pytest.raises(ConfigError, match="2 row counts but 1 prefix lengths"):
        CascadeGroups.build([3, 2], [32], PAGE, "cpu")
    with pytest.raises(ConfigError, match=r"cascade groups \(num_groups\) do not fit in 1"):
        CascadeGroups.build([3, 2], [32, 16], PAGE, "cpu", num_groups=1)
    with pytest.raises(ConfigError, match="max_rows 2"):
        CascadeGroups.build([3, 2], [32, 16], PAGE, "cpu", max_rows=2)
    meta = CascadeGroups.build([3, 2], [32, 0], PAGE, "cpu", num_groups=3)
    assert meta.starts.tolist() == [0, 3, 5, 5] and meta.prefix_lens.tolist() == [32, 0, 0]
    assert (meta.max_rows, meta.max_prefix_len) == (3, 32)


def test_kernel_refuses_bad_shapes():
    from nanosched.kernels.cascade_attn import CascadeGroups, cascade_decode_attention

    groups = [(1, [20, 30])]
    kc, vc, tables, lens, q, _, _ = make_case(groups)
    meta = CascadeGroups.build([2], [16], PAGE, "cpu")
    args = (q, kc, vc, tables, lens, 30, D ** -0.5)
    with pytest.raises(ConfigError, match=r"out \(2, 8, 16\) != q \(2, 8, 32\)"):
        cascade_decode_attention(*args, torch.empty(2, 8, 16), meta)
    with pytest.raises(ConfigError, match="max_prefix_len 24 is not a multiple"):
        cascade_decode_attention(*args, torch.empty_like(q),
                                 CascadeGroups(meta.starts, meta.prefix_lens, 2, 24))
    with pytest.raises(ConfigError, match=r"starts \(2,\) torch.int64"):
        cascade_decode_attention(*args, torch.empty_like(q),
                                 CascadeGroups(meta.starts.long(), meta.prefix_lens, 2, 16))
    with pytest.raises(ConfigError, match=r"context_lens \(1,\)"):
        cascade_decode_attention(q, kc, vc, tables, lens[:1], 30, D ** -0.5,
                                 torch.empty_like(q), meta)
    with pytest.raises(ConfigError, match="q's 8 heads are not a multiple of the cache's 3"):
        cascade_decode_attention(q, kc[:, :, :1].expand(-1, -1, 3, -1),
                                 vc[:, :, :1].expand(-1, -1, 3, -1), tables, lens, 30,
                                 D ** -0.5, torch.empty_like(q), meta)
