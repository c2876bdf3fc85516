"""The Triton paged prefill attention kernel against reference.prefill_attention, on CPU through
TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU): fresh prompts, chunks continuing a
cached prefix over several pages, several segments per call, GQA groups 1, 2 and 4, head dims
16, 64 and 128, pages of 16 and 4, padding segments, fp32 and fp16; and the launch reading its
segments from the device tensors (one grid, new metadata, right results).

The reference runs in fp32 on the same (rounded) inputs: fp32 within 1e-5, fp16 within 2e-3
(P is rounded to fp16 before the P·V dot, as in flash attention), relative L2 error.
"""

from __future__ import annotations

import os

import pytest
import torch

from nanosched.errors import ConfigError
from nanosched.kernels import reference as ref
from nanosched.kernels.common import PrefillSegments
from nanosched.kernels.dispatch import triton_available

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="needs triton and TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")

DTYPES = [torch.float32, torch.float16]
BAD_PAGE = 10 ** 6  # a block-table entry that would fault if a padding segment read it


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-3


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def pages_needed(segments, page: int) -> list[int]:
    return [-(-(p + e - s) // page) for s, e, p in segments]


def block_tables(segments, page: int, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """[S, max pages] int32 over shuffled pages holding every segment's first_pos + length
    tokens; unused entries point far outside the cache."""
    need = pages_needed(segments, page)
    perm = torch.randperm(num_pages, generator=gen).int()
    tables = torch.full((len(segments), max(need, default=1)), BAD_PAGE, dtype=torch.int32)
    at = 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[at:at + k]
        at += k
    return tables


def paged(segments, hkv: int, d: int, page: int, dtype: torch.dtype, gen: torch.Generator):
    """Random K/V caches [P, page, hkv, d] and block tables for `segments`."""
    num_pages = sum(pages_needed(segments, page)) + 2
    kc = torch.randn(num_pages, page, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(num_pages, page, hkv, d, generator=gen).to(dtype)
    return kc, vc, block_tables(segments, page, num_pages, gen)


def reference(q, kc, vc, tables, segments, scale) -> torch.Tensor:
    want = torch.zeros(q.shape)
    ref.prefill_attention(q.float(), kc.float(), vc.float(), tables, segments, scale, want)
    return want


CASES = {  # name: (segments, Hkv, group, head dim, page size, tiles (BM, BN) or None)
    "fresh_g1_d64_p16": ([(0, 37, 0), (37, 40, 0)], 2, 1, 64, 16, (32, 16)),
    "continuing_g4_d128_p4": ([(0, 21, 45)], 1, 4, 128, 4, None),
    "mixed_g4_d64_p16": ([(0, 5, 0), (5, 40, 19), (40, 41, 70), (41, 60, 0)], 2, 4, 64, 16,
                         (16, 32)),
    "models_g2_d16_p4": ([(0, 9, 6), (9, 20, 0)], 2, 2, 16, 4, (32, 16)),
    # every segment ends in a partial m-tile: the grid's bound of one extra tile per segment
    "short_g4_d16_p4": ([(0, 5, 3), (5, 6, 0), (6, 9, 7), (9, 15, 0), (15, 16, 2)], 1, 4, 16, 4,
                        (16, 16)),
}


@pytest.mark.parametrize("pages_ahead", [True, False], ids=["pages-ahead", "pages-in-step"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_attention_matches_reference(case, dtype, pages_ahead):
    from dataclasses import replace

    from nanosched.kernels.prefill_attn import PrefillConfig, default_config, prefill_attention

    segments, hkv, group, d, page, tiles = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    kc, vc, tables = paged(segments, hkv, d, page, dtype, gen)
    n = segments[-1][1]
    q = torch.randn(n, hkv * group, d, generator=gen).to(dtype)
    buf = torch.full((n + 3, hkv * group, d), float("nan"), dtype=dtype)
    out = buf[2:2 + n]  # a row slice of a larger buffer
    cfg = PrefillConfig(*tiles, num_warps=4, num_stages=1) if tiles else default_config(dtype)
    prefill_attention(q, kc, vc, tables, segments, d ** -0.5, out,
                      replace(cfg, pages_ahead=pages_ahead))
    assert rel_err(out, reference(q, kc, vc, tables, segments, d ** -0.5)) < tol(dtype)
    assert buf[:2].isnan().all() and buf[2 + n:].isnan().all()  # nothing written outside


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_segments_of_length_zero_are_harmless(dtype):
    """Empty segments (inside the list and as bucket padding, their block tables pointing far
    outside the cache) are never read and write nothing."""
    from nanosched.kernels.prefill_attn import PrefillConfig, prefill_attention

    segments = [(0, 18, 30), (18, 18, 0), (18, 25, 0)]
    gen = torch.Generator().manual_seed(3)
    kc, vc, tables = paged(segments, 2, 32, 16, dtype, gen)
    tables = torch.cat([tables, torch.full((3, tables.shape[1]), BAD_PAGE, dtype=torch.int32)])
    q = torch.randn(26, 4, 32, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    meta = PrefillSegments.build(segments, "cpu", num_segments=6)
    prefill_attention(q, kc, vc, tables, meta, 32 ** -0.5, out, PrefillConfig(16, 16, 4, 1))
    want = reference(q, kc, vc, tables, segments, 32 ** -0.5)
    assert rel_err(out[:25], want[:25]) < tol(dtype)
    assert out[25].isnan().all()  # the row no segment covers is untouched


def test_launch_reads_segments_from_the_device_tensors():
    """One metadata object, one grid bound: rewriting its tensors (and the block tables) in place
    between two launches gives each launch the result of its own segments, as a CUDA graph
    replaying the launch would."""
    from nanosched.kernels.prefill_attn import PrefillConfig, prefill_attention

    cfg = PrefillConfig(16, 16, 4, 1)
    first, second = [(0, 20, 0), (20, 24, 33)], [(0, 3, 50), (3, 9, 0), (9, 29, 11)]
    gen = torch.Generator().manual_seed(4)
    kc, vc, tables_b = paged(second, 1, 16, 4, torch.float32, gen)  # the larger cache
    tables_a = block_tables(first + [(0, 0, 0)], 4, kc.shape[0], gen)
    width = max(tables_a.shape[1], tables_b.shape[1])
    tables = torch.zeros(3, width, dtype=torch.int32)
    q = torch.randn(29, 4, 16, generator=gen)
    meta = PrefillSegments.build(first, "cpu", num_segments=3)
    results = []
    for segments, tab in ((first, tables_a), (second, tables_b)):
        meta.write(segments)  # in place: the launch below gets the same tensors
        tables.zero_()
        tables[:, :tab.shape[1]] = tab
        out = torch.zeros_like(q)
        prefill_attention(q, kc, vc, tables, PrefillSegments(meta.table), 0.25,
                          out, cfg)  # no host tuples: only the device tensors say what to do
        results.append((out, reference(q, kc, vc, tables, segments, 0.25)))
    for got, want in results:
        assert rel_err(got, want) < 1e-5
    assert results[0][0][24:].abs().sum() == 0  # rows past the first launch's segments
    assert rel_err(results[0][0], results[1][1]) > 0.1  # the two launches differ


def test_bad_shapes_and_tiles_are_refused():
    from nanosched.kernels.prefill_attn import PrefillConfig, prefill_attention

    kc = torch.zeros(2, 4, 2, 16)
    q = torch.zeros(5, 3, 16)
    with pytest.raises(ConfigError, match="3 query heads are not a multiple of 2 KV heads"):
        prefill_attention(q, kc, kc, torch.zeros(1, 2, dtype=torch.int32), [(0, 5, 0)], 1.0,
                          torch.empty_like(q))
    q = torch.zeros(5, 4, 16)
    with pytest.raises(ConfigError, match="block_tables has 1 rows for 2 segments"):
        prefill_attention(q, kc, kc, torch.zeros(1, 2, dtype=torch.int32),
                          [(0, 2, 0), (2, 5, 0)], 1.0, torch.empty_like(q))
    with pytest.raises(ConfigError, match="ends past the 5 rows of q"):
        prefill_attention(q, kc, kc, torch.zeros(1, 2, dtype=torch.int32), [(0, 6, 0)], 1.0,
                          torch.empty_like(q))
    with pytest.raises(ConfigError, match="prefill tiles 48x64 must be in"):
        PrefillConfig(block_m=48)
