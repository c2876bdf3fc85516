"""Page allocator, block tables, batch metadata slicing and the torch attention references."""

from __future__ import annotations

import math

import pytest
import torch

from nanosched.errors import ConfigError
from nanosched.kernels import reference as ref
from nanosched.kernels.common import PrefillSegments
from nanosched.models.batch import BatchMeta, SeqChunk
from nanosched.models.kvcache import CacheFullError, KVCache, PageAllocator


def test_allocator_hands_out_and_takes_back_pages():
    alloc = PageAllocator(4)
    assert alloc.allocate(3) == [0, 1, 2] and alloc.num_free == 1
    with pytest.raises(CacheFullError, match="2 pages needed, 1 of 4 free"):
        alloc.allocate(2)
    alloc.free([1, 2])
    assert sorted(alloc.allocate(3)) == [1, 2, 3]


def test_plan_reserves_pages_and_builds_metadata():
    cache = KVCache(num_layers=1, num_pages=8, num_kv_heads=1, head_dim=4,
                    dtype=torch.float32, page_size=4)
    cache.plan([(7, 6, False)])  # request 7: positions 0..5, pages [0, 1]
    meta = cache.plan([(7, 1, True), (9, 5, False)])
    assert cache.tables == {7: [0, 1], 9: [2, 3]} and cache.lengths == {7: 7, 9: 5}
    assert meta.num_decode == 1 and meta.num_tokens == 6
    assert meta.positions.tolist() == [6, 0, 1, 2, 3, 4]
    assert meta.slot_mapping.tolist() == [1 * 4 + 2, 8, 9, 10, 11, 12]
    assert meta.context_lens.tolist() == [7, 5]
    cache.release(7)
    assert cache.allocator.num_free == 6 and 7 not in cache.tables


def test_slice_cuts_a_prompt_and_keeps_its_earlier_context():
    chunks = [SeqChunk((0, 1), 5, 1, True), SeqChunk((2, 3, 4), 3, 8, False),
              SeqChunk((5,), 0, 2, False)]
    meta = BatchMeta.build(chunks, page_size=4)  # tokens: 1 decode, 8 + 2 prefill
    part = meta.slice(3, 8)  # prefill positions 5..9 of the second request
    assert part.num_decode == 0 and part.positions.tolist() == [5, 6, 7, 8, 9]
    assert part.seg_first_pos == (5,) and part.context_lens_cpu == (10,)
    assert part.block_tables.tolist() == [[2, 3, 4]]
    assert part.prefill_segments() == [(0, 5, 5)]
    segs = meta.prefill_tensors()  # both prefill segments, after the decode token
    assert segs.table.tolist() == [[0, 8], [8, 2], [3, 0]]
    assert segs.host == ((0, 8, 3), (8, 10, 0)) and meta.prefill_tensors() is segs  # memoised
    head = meta.slice(0, 3)
    assert head.num_decode == 1 and head.context_lens_cpu == (6, 5)
    assert meta.slice(0, 3) is head  # memoised
    assert head.slice(1, 3).context_lens_cpu == (5,)
    with pytest.raises(ConfigError, match=r"token range \[2, 12\) is not inside"):
        meta.slice(2, 12)


@pytest.mark.parametrize("chunks, message", [
    ([SeqChunk((0,), 0, 2, True)], "decode chunks have one token"),
    ([SeqChunk((0,), 0, 2, False), SeqChunk((1,), 3, 1, True)], "come before every prefill"),
    ([SeqChunk((0,), 3, 3, False)], "block table has 1 pages, positions up to 5 need 2"),
])
def test_bad_chunks_are_rejected(chunks, message):
    with pytest.raises(ConfigError, match=message):
        BatchMeta.build(chunks, page_size=4)


def naive_attention(q, k, v, scale):
    """q [m, Hq, d] at the last m positions of k, v [L, Hkv, d]; causal."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("mhd,lhd->hml", q, k) * scale
    length, m = k.shape[0], q.shape[0]
    mask = torch.arange(length)[None, :] > torch.arange(length - m, length)[:, None]
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hml,lhd->mhd", probs, v)


def test_reference_attention_over_pages_matches_naive():
    torch.manual_seed(0)
    pages, page, hkv, hq, d = 10, 4, 2, 6, 8
    kc, vc = torch.randn(pages, page, hkv, d), torch.randn(pages, page, hkv, d)
    table = torch.tensor([[7, 2, 9, 0]], dtype=torch.int32)
    k, v = ref.gather_kv(kc, table[0], 14), ref.gather_kv(vc, table[0], 14)
    assert torch.equal(k[5], kc[2, 1])
    q = torch.randn(14, hq, d)
    out = torch.empty_like(q)
    ref.prefill_attention(q[:9], kc, vc, table, [(0, 9, 0)], 0.3, out[:9])  # first chunk
    ref.prefill_attention(q[9:], kc, vc, table, [(0, 5, 9)], 0.3, out[9:])  # second chunk
    torch.testing.assert_close(out, naive_attention(q, k, v, 0.3))
    dec = torch.empty(1, hq, d)
    ref.decode_attention(q[13:], kc, vc, table, torch.tensor([14], dtype=torch.int32), 14,
                         0.3, dec)
    torch.testing.assert_close(dec, naive_attention(q[13:], k, v, 0.3))
    assert math.isfinite(dec.sum().item())


def test_prefill_segments_pad_to_a_bucket_and_are_rewritten_in_place():
    segs = PrefillSegments.build([(0, 5, 0), (5, 9, 12)], "cpu", num_segments=4)
    assert segs.table.tolist() == [[0, 5, 0, 0], [5, 4, 0, 0], [0, 12, 0, 0]]
    assert segs.num_segments == 4 and segs.as_list() == [(0, 5, 0), (5, 9, 12)]
    table = segs.table
    new = segs.write([(0, 16, 3), (16, 17, 0), (17, 20, 40)])
    assert new.table is table and table.tolist() == [[0, 16, 17, 0], [16, 1, 3, 0],
                                                     [3, 0, 40, 0]]
    assert PrefillSegments(table).as_list() == [(0, 16, 3), (16, 17, 0), (17, 20, 40)]
    with pytest.raises(ConfigError, match="5 prefill segments do not fit in 4"):
        segs.write([(i, i + 1, 0) for i in range(5)])
    with pytest.raises(ConfigError, match="needs 0 <= start <= end"):
        PrefillSegments.build([(3, 2, 0)], "cpu")
