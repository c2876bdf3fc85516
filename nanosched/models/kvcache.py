"""Paged KV cache: a page allocator, per-request block tables, and batch planning.

Storage: per layer `k[layer]`, `v[layer]` of shape [P, S, Hkv, d] (P pages of S tokens, the
tp rank's KV heads). A request owns a list of pages (its block table); position p of the
request lives at page table[p // S], offset p % S. `plan(...)` reserves pages for the tokens a
batch will write, advances each request's length and returns the batch's `BatchMeta`.
Pages are zero-initialised so that padded reads never meet NaNs. One page past the allocator's
(`scratch_slot`) is never handed out: the padded rows of a CUDA-graph bucket write their K/V
there, so they never touch a request's pages. Pages are reference-counted; a full page may be
cached under its content hash and shared by requests with the same prefix (`PageAllocator`).

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from nanosched.constants import KV_DTYPES, PAGE_SIZE
from nanosched.errors import ConfigError, NanoschedError
from nanosched.kernels.reference import quantize_fp8
from nanosched.models.batch import BatchMeta, SeqChunk


class CacheFullError(NanoschedError):
    """The KV cache has too few free pages for a request."""


class PageAllocator:
    """Pages 0..num_pages-1, each with a reference count (the requests whose block tables hold
    it). A full page may also be cached under its content hash (models/prefix.py): when its
    last user lets go it goes to an LRU of free cached pages instead of the free list, and
    another request may take it back by that hash (`lookup`, `share`); a page is evicted
    (its hash dropped) only when the free list is empty and a new page is needed."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ConfigError(f"KV cache needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.refs = [0] * num_pages
        self.page_hash: dict[int, int] = {}  # cached page -> its content hash
        self.by_hash: dict[int, int] = {}  # content hash -> cached page
        self._lru: OrderedDict[int, None] = OrderedDict()  # free cached pages, oldest first
        self.evictions = 0  # cached pages whose hash was dropped to reuse the page

    @property
    def num_free(self) -> int:
        """Pages no request holds: never cached, or cached and evictable."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Pages that hold a hash (in use or free)."""
        return len(self.page_hash)

    @property
    def num_in_use(self) -> int:
        """Pages some request holds (a page shared by several counts once)."""
        return self.num_pages - self.num_free

    def allocate(self, count: int) -> list[int]:
        """Take `count` pages (from the free list, then the least recently freed cached
        pages, whose hashes are dropped); raises CacheFullError when fewer are free."""
        if count > self.num_free:
            raise CacheFullError(f"KV cache: {count} pages needed, {self.num_free} of "
                                 f"{self.num_pages} free")
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._lru.popitem(last=False)
                del self.by_hash[self.page_hash.pop(page)]
                self.evictions += 1
            self.refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Let go of `pages` (one reference each, last page first so that a freed sequence's
        tail is evicted before its head); a page nobody holds is refused."""
        for page in reversed(pages):
            if self.refs[page] <= 0:
                raise NanoschedError(f"KV page {page} freed but no request holds it")
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.page_hash:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    def share(self, pages: Sequence[int]) -> None:
        """One more reference to each of `pages` (cached pages found by `lookup`)."""
        for page in pages:
            if self.refs[page] == 0:
                if page not in self._lru:
                    raise NanoschedError(f"KV page {page} is neither held nor cached")
                del self._lru[page]
            self.refs[page] += 1

    def register(self, page: int, content: int) -> bool:
        """Cache held, fully written `page` under hash `content`; False (nothing changes) when
        another page already holds that hash or this page holds one."""
        if self.refs[page] <= 0:
            raise NanoschedError(f"KV page {page} cached but no request holds it")
        if content in self.by_hash or page in self.page_hash:
            return False
        self.by_hash[content] = page
        self.page_hash[page] = content
        return True

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The cached pages of the longest prefix of `hashes` (a chain: page i's hash covers
        pages 0..i)."""
        pages = []
        for content in hashes:
            page = self.by_hash.get(content)
            if page is None:
                break
            pages.append(page)
        return pages


class KVLayer(NamedTuple):
    """One layer's cache tensors: K, V [P + 1, S, Hkv, d] and, for an FP8 cache, their scales
    [P + 1, S, Hkv] (None otherwise)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    @property
    def scales(self) -> dict[str, Any]:
        """The scales as the kernels' keyword arguments."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def check_kv_dtype(kv_dtype: str) -> str:
    """`kv_dtype` if it names a KV cache dtype, else a ConfigError that lists them."""
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"KV cache dtype {kv_dtype!r} is not one of {KV_DTYPES} ('auto': the "
                          f"model's dtype; 'fp8': e4m3 with a scale per token and KV head)")
    return kv_dtype


class KVCache:
    """Paged K/V storage for every layer plus the block table and length of each request."""

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 page_size: int = PAGE_SIZE, kv_dtype: str = "auto") -> None:
        if page_size <= 0:
            raise ConfigError(f"page size must be positive, got {page_size}")
        self.kv_dtype = check_kv_dtype(kv_dtype)
        store = torch.float8_e4m3fn if kv_dtype == "fp8" else dtype
        shape = (num_layers, num_pages + 1, page_size, num_kv_heads, head_dim)  # + scratch
        self.k = torch.zeros(shape, dtype=store, device=device)  # [L, P, S, Hkv, d]
        self.v = torch.zeros(shape, dtype=store, device=device)
        self.k_scale: torch.Tensor | None = None  # [L, P, S, Hkv] fp32, FP8 only
        self.v_scale: torch.Tensor | None = None
        if kv_dtype == "fp8":
            self.k_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
        self.page_size = page_size
        self.device = torch.device(device)
        self.allocator = PageAllocator(num_pages)
        self.scratch_slot = num_pages * page_size  # the first slot of the scratch page
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by page on dim 1 ([L, P + 1, ...]): what a page's data is."""
        scales = [] if self.k_scale is None else [self.k_scale, self.v_scale]
        return [self.k, self.v, *scales]

    def layer(self, index: int) -> KVLayer:
        """Layer `index`'s K, V and (FP8) scales, as the attention kernels take them."""
        if self.k_scale is None:
            return KVLayer(self.k[index], self.v[index], None, None)
        return KVLayer(self.k[index], self.v[index], self.k_scale[index], self.v_scale[index])

    def fill_random(self, generator: torch.Generator) -> None:
        """Standard-normal K and V in every slot (quantised for FP8): finite cached context for
        benchmarks that attend to tokens no prompt wrote."""
        for cache, scale in ((self.k, self.k_scale), (self.v, self.v_scale)):
            if scale is None:
                cache.normal_(generator=generator)
                continue
            for i in range(cache.shape[0]):  # a layer at a time: the fp32 copy stays small
                x = torch.randn(cache.shape[1:], generator=generator, device=cache.device)
                cache[i], scale[i] = quantize_fp8(x)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token keeps in the cache, all layers, every page tensor."""
        page = sum(t[:, 0].numel() * t.element_size() for t in self.page_tensors())
        return page // self.page_size

    def num_held(self, request: int) -> int:
        """Pages `request` holds (0 for an unknown request)."""
        return len(self.tables.get(request, ()))

    def adopt(self, request: int, pages: list[int], length: int) -> None:
        """Give `request` (holding no pages) the block table `pages`, `length` tokens written
        (a swap-in: the caller copies the data)."""
        if self.tables.get(request):
            raise ConfigError(f"request {request} already holds KV pages")
        if len(pages) * self.page_size < length:
            raise ConfigError(f"{len(pages)} pages cannot hold {length} tokens")
        self.tables[request] = list(pages)
        self.lengths[request] = length

    def share(self, request: int, pages: list[int], length: int) -> None:
        """Give `request` (holding no pages) the cached `pages` as its first `length` tokens
        (a prefix-cache hit: one more reference each)."""
        if self.tables.get(request):
            raise ConfigError(f"request {request} already holds KV pages")
        if len(pages) * self.page_size < length:
            raise ConfigError(f"{len(pages)} pages cannot hold {length} tokens")
        self.allocator.share(pages)
        self.tables[request] = list(pages)
        self.lengths[request] = length

    def register(self, page: int, content: int) -> bool:
        """Cache `page` under its content hash (`PageAllocator.register`)."""
        return self.allocator.register(page, content)

    def length(self, request: int) -> int:
        """Tokens of `request` already written (0 for an unknown request)."""
        return self.lengths.get(request, 0)

    def reserve(self, request: int, new_length: int) -> None:
        """Make `request`'s block table cover positions 0..new_length-1."""
        table = self.tables.setdefault(request, [])
        self.lengths.setdefault(request, 0)
        needed = -(-new_length // self.page_size) - len(table)
        if needed > 0:
            table.extend(self.allocator.allocate(needed))

    def release(self, request: int) -> None:
        """Free every page of a finished request."""
        self.allocator.free(self.tables.pop(request, []))
        self.lengths.pop(request, None)

    def plan(self, chunks: Sequence[tuple[int, int, bool]]) -> BatchMeta:
        """Reserve pages and build the metadata of a batch (`plan_chunks`, then
        `BatchMeta.build`)."""
        return BatchMeta.build(self.plan_chunks(chunks), self.page_size, self.device)

    def plan_chunks(self, chunks: Sequence[tuple[int, int, bool]]) -> list[SeqChunk]:
        """Reserve pages for a batch and describe its chunks.

        chunks: (request id, number of new tokens, is_decode) in batch order, decode first.
        Each request's new tokens continue at its current length, which then advances.
        """
        seqs = []
        for request, num_tokens, is_decode in chunks:
            first = self.length(request)
            self.reserve(request, first + num_tokens)
            self.lengths[request] = first + num_tokens
            seqs.append(SeqChunk(tuple(self.tables[request]), first, num_tokens, is_decode))
        return seqs
