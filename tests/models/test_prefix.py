"""Prefix caching's bookkeeping: the page hash chain, reference counts, the LRU of free cached
pages and its eviction, and the refusals that catch a double free."""

from __future__ import annotations

import pytest
import torch

from nanosched.errors import NanoschedError
from nanosched.models.kvcache import KVCache, PageAllocator
from nanosched.models.prefix import chain_hashes, page_hash, prefix_seed


def test_hash_chain_names_a_page_by_its_whole_prefix():
    seed = prefix_seed("llama", "fp8")
    a = chain_hashes(seed, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = chain_hashes(seed, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a == b  # the partial last page has no hash
    assert chain_hashes(seed, [0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1]  # page 0 differs
    assert chain_hashes(prefix_seed("llama", "auto"), [1, 2, 3, 4], 4)[0] != a[0]
    assert a[1] == page_hash(page_hash(seed, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert prefix_seed("x", 1) == prefix_seed("x", 1) != prefix_seed("x", 2)


def test_shared_pages_are_counted_and_freed_by_their_last_user():
    alloc = PageAllocator(4)
    p = alloc.allocate(2)
    assert alloc.register(p[0], 10) and alloc.register(p[1], 11)
    assert not alloc.register(p[1], 12)  # a page keeps its first hash
    alloc.share(alloc.lookup([10, 11, 99]))
    assert alloc.refs[:2] == [2, 2] and alloc.num_free == 2 and alloc.num_in_use == 2
    alloc.free(p)
    assert alloc.refs[:2] == [1, 1] and alloc.num_free == 2
    alloc.free(p)
    assert alloc.num_free == 4 and alloc.num_cached == 2 and alloc.lookup([10, 11]) == p
    with pytest.raises(NanoschedError, match="freed but no request holds it"):
        alloc.free([p[0]])


def test_free_cached_pages_are_evicted_least_recently_freed_first_and_tail_first():
    alloc = PageAllocator(4)
    a, b = alloc.allocate(2), alloc.allocate(2)
    for page, h in zip(a + b, (1, 2, 3, 4), strict=True):
        alloc.register(page, h)
    alloc.free(a)
    alloc.free(b)
    assert alloc.num_free == 4 and alloc.evictions == 0
    # nothing uncached is free: the oldest freed sequence goes first, its tail before its head
    assert alloc.allocate(1) == [a[1]] and alloc.lookup([1, 2]) == [a[0]]
    assert alloc.evictions == 1 and alloc.lookup([3, 4]) == b
    alloc.share([a[0]])  # taking a free cached page back removes it from the LRU
    assert alloc.allocate(2) == [b[1], b[0]] and alloc.lookup([3]) == []
    assert alloc.num_free == 0 and alloc.num_cached == 1


def test_uncached_free_pages_go_before_any_cached_page_is_evicted():
    alloc = PageAllocator(3)
    p = alloc.allocate(2)
    alloc.register(p[0], 7)
    alloc.free(p)
    assert alloc.allocate(2) == [1, 2] and alloc.lookup([7]) == [p[0]]


def test_cache_shares_a_block_table_prefix():
    kv = KVCache(num_layers=1, num_pages=6, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                 page_size=4)
    kv.plan([(1, 9, False)])
    kv.register(kv.tables[1][0], 5)
    kv.share(2, kv.allocator.lookup([5]), 4)
    assert kv.length(2) == 4 and kv.tables[2] == [kv.tables[1][0]]
    kv.plan([(2, 3, False)])
    assert kv.tables[2][1] not in kv.tables[1] and kv.allocator.refs[kv.tables[1][0]] == 2
    with pytest.raises(Exception, match="already holds KV pages"):
        kv.share(2, [0], 4)
    kv.release(1)
    kv.release(2)
    assert kv.allocator.num_free == 6 and not any(kv.allocator.refs)
