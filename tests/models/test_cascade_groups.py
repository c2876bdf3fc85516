"""Prefix groups of decode rows (models/cascade.py) and the metadata that carries them: eager
`BatchMeta` (groups only when some rows share a page; slices without every decode row get
none) and the CUDA-graph `BucketMeta` (a fixed group count and bounds, rewritten in place per
batch, before and after freezing)."""

import numpy as np
import pytest
import torch

from nanosched.errors import ConfigError
from nanosched.kernels.common import group_starts
from nanosched.models.batch import BatchMeta, SeqChunk
from nanosched.models.bucket import Bucket, BucketMeta
from nanosched.models.cascade import BUCKET_GROUPS, decode_groups, group_order

PAGE = 4


def rows_of(tables, lens, max_groups=None):
    width = max(len(t) for t in tables)
    arr = np.array([list(t) + [0] * (width - len(t)) for t in tables], dtype=np.int32)
    rows, pages = decode_groups(arr, np.array(lens, dtype=np.int32), PAGE, max_groups)
    return rows.tolist(), pages.tolist()


def test_groups_take_the_pages_all_their_rows_share_never_a_last_page():
    tables = [
        (1, 2, 3, 10), (1, 2, 3, 11), (1, 2, 4),  # page 1 first: share 2 pages (the third differs)
        (5, 6, 7), (5, 6, 8, 9),  # page 5 first: share 2 pages
        (20, 21),  # alone
        (30, 31, 32), (30, 31, 33),  # page 30 first: share 2 pages
    ]
    lens = [14, 16, 10, 12, 13, 8, 9, 12]
    assert rows_of(tables, lens) == ([3, 2, 1, 2], [2, 2, 0, 2])


def test_a_row_whose_context_is_the_shared_pages_keeps_its_last_page_out():
    # both rows hold pages 7, 8; the first fills exactly two pages, so page 8 is its last
    assert rows_of([(7, 8), (7, 8, 9)], [8, 9]) == ([2], [1])
    # one more token: page 8 is full and the row's last page is a new one
    assert rows_of([(7, 8, 12), (7, 8, 9)], [9, 10]) == ([2], [2])
    # a context within its first page shares no page, so the run is no group
    assert rows_of([(7,), (7, 8)], [3, 6]) == ([2], [0])


def test_rows_that_share_nothing_are_one_group_of_prefix_zero():
    assert rows_of([(1, 2), (3, 4), (5, 6)], [6, 6, 6]) == ([3], [0])
    assert rows_of([(1, 2), (1, 3)], [4, 4]) == ([2], [0])  # one first page, each's last
    # stretches of other rows between groups, and only consecutive rows group
    tables = [(9, 1), (2, 3, 4), (2, 3, 5), (8, 1), (9, 1)]
    assert rows_of(tables, [6, 9, 9, 6, 6]) == ([1, 2, 2], [0, 2, 0])
    rows, pages = decode_groups(np.zeros((0, 3), np.int32), np.zeros(0, np.int32), PAGE)
    assert rows.tolist() == [] and pages.tolist() == []


def test_groups_past_the_maximum_join_a_last_group_of_prefix_zero():
    tables = [(g, 100 + r) for g in range(5) for r in range(2)]  # five groups of two rows
    assert rows_of(tables, [6] * 10) == ([2] * 5, [1] * 5)
    assert rows_of(tables, [6] * 10, max_groups=3) == ([2, 2, 6], [1, 1, 0])
    assert rows_of(tables, [6] * 10, max_groups=1) == ([10], [0])
    with pytest.raises(ConfigError, match="max_groups 0"):
        rows_of(tables, [6] * 10, max_groups=0)
    with pytest.raises(ConfigError, match=r"block tables \(2, 2\) must be \[3, pages\]"):
        decode_groups(np.zeros((2, 2), np.int32), np.zeros(3, np.int32), PAGE)


def test_group_order_puts_shared_first_pages_side_by_side_first():
    assert group_order([5, 1, 5, 7, 1, 9]) == [1, 4, 0, 2, 3, 5]
    assert group_starts(np.array([2, 3]), 4) == [0, 2, 5, 5, 5]


def decode(table, ctx):
    return SeqChunk(tuple(table), ctx - 1, 1, True)


def shared_batch():
    """Three rows on prefix pages 1, 2 (one shorter), one alone, then a prompt chunk."""
    return [decode((1, 2, 3), 10), decode((1, 2, 4), 11), decode((1, 2, 6), 9),
            decode((7, 8), 6), SeqChunk((9, 10), 0, 5, False)]


def test_batch_meta_carries_groups_only_with_cascade_and_a_shared_page():
    meta = BatchMeta.build(shared_batch(), PAGE, cascade=True)
    g = meta.cascade_groups()
    assert g.starts.tolist() == [0, 3, 4] and g.prefix_lens.tolist() == [8, 0]
    assert (g.max_rows, g.max_prefix_len) == (3, 8)
    assert BatchMeta.build(shared_batch(), PAGE).cascade_groups() is None
    lonely = [decode((1, 2, 3), 10), decode((5, 2, 4), 11)]
    assert BatchMeta.build(lonely, PAGE, cascade=True).cascade_groups() is None
    # a range with every decode row keeps them; one without some runs the ordinary attention
    assert meta.slice(0, 5).cascade_groups() is g
    assert meta.slice(0, 3).cascade_groups() is None
    assert meta.slice(2, 8).cascade_groups() is None


def bucket_meta(frozen):
    b = Bucket(num_decode=8, num_tokens=16, num_segments=4, max_pages=6)
    meta = BucketMeta(b, PAGE, scratch_slot=0, device="cpu", cascade=True)
    meta.slice(0, 12)  # a nano-batch with every decode row, and one without
    meta.slice(4, 16)
    meta.write(shared_batch())
    if frozen:
        meta.freeze()
    return meta


@pytest.mark.parametrize("frozen", [False, True])
def test_bucket_meta_writes_fixed_groups_in_place_per_batch(frozen):
    meta = bucket_meta(frozen)
    g = meta.cascade_groups()
    starts, plens = g.starts, g.prefix_lens
    assert g.num_groups == BUCKET_GROUPS and (g.max_rows, g.max_prefix_len) == (8, 6 * PAGE)
    # the group, the lone row, the padded rows, then empty groups
    assert starts.tolist() == [0, 3, 4, 8] + [8] * (BUCKET_GROUPS - 3)
    assert plens.tolist() == [8, 0, 0] + [0] * (BUCKET_GROUPS - 3)
    assert meta.slice(0, 12).cascade_groups().starts.data_ptr() == starts.data_ptr()
    assert meta.slice(4, 16).cascade_groups() is None
    # the next batch: two groups of two rows; same tensors, new values
    meta.write([decode((3, 4, 5), 9), decode((3, 4, 6), 10), decode((7, 1), 7),
                decode((7, 2), 6), SeqChunk((9, 10), 0, 3, False)])
    again = meta.cascade_groups()
    assert again.starts.data_ptr() == starts.data_ptr()
    assert again.starts.tolist()[:5] == [0, 2, 4, 8, 8] and again.prefix_lens.tolist()[:3] == \
        [8, 4, 0]
    assert meta.decode_tables()[1].tolist()[:5] == [9, 10, 7, 6, 0]  # the rest still written


def test_bucket_meta_keeps_its_group_count_past_the_maximum():
    b = Bucket(num_decode=2 * BUCKET_GROUPS + 8, num_tokens=2 * BUCKET_GROUPS + 8,
               num_segments=0, max_pages=2)
    meta = BucketMeta(b, PAGE, scratch_slot=0, device="cpu", cascade=True)
    meta.write([decode((g, 500 + r), 6) for g in range(BUCKET_GROUPS + 4) for r in range(2)])
    g = meta.cascade_groups()
    assert g.num_groups == BUCKET_GROUPS
    assert g.prefix_lens.tolist() == [PAGE] * (BUCKET_GROUPS - 2) + [0, 0]
    assert g.starts.tolist()[-3:] == [2 * BUCKET_GROUPS - 4, 2 * BUCKET_GROUPS + 8,
                                      2 * BUCKET_GROUPS + 8]
    plain = BucketMeta(b, PAGE, scratch_slot=0, device="cpu")
    plain.write([decode((1, 2), 6)])
    assert plain.cascade_groups() is None and torch.equal(plain.decode_tables()[1][:1],
                                                          torch.tensor([6], dtype=torch.int32))
