"""Paged KV cache: a page allocator, per-request block tables, and batch planning.

Storage: per layer `k[layer]`, `v[layer]` of shape [P, S, Hkv, d] (P pages of S tokens, the
tp rank's KV heads). A request owns a list of pages (its block table); position p of the
request lives at page table[p // S], offset p % S. `plan(...)` reserves pages for the tokens a
batch will write, advances each request's length and returns the batch's `BatchMeta`.
Pages are zero-initialised so that padded reads never meet NaNs. One page past the allocator's
(`scratch_slot`) is never handed out: the padded rows of a CUDA-graph bucket write their K/V
there, so they never touch a request's pages.

Every tensor that holds a page's data has the page on dim 1 (`page_tensors()`: K and V; a
quantised cache adds its scales there), so code that moves pages (runtime/offload.py) and
sizes them (`bytes_per_token`) works for any KV dtype and layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanosched.constants import PAGE_SIZE
from nanosched.errors import ConfigError, NanoschedError
from nanosched.models.batch import BatchMeta, SeqChunk


class CacheFullError(NanoschedError):
    """The KV cache has too few free pages for a request."""


class PageAllocator:
    """Free list of page ids 0..num_pages-1."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ConfigError(f"KV cache needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` pages; raises CacheFullError when fewer are free."""
        if count > len(self._free):
            raise CacheFullError(f"KV cache: {count} pages needed, {len(self._free)} of "
                                 f"{self.num_pages} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, pages: Sequence[int]) -> None:
        """Return pages to the free list."""
        self._free.extend(reversed(pages))


class KVCache:
    """Paged K/V storage for every layer plus the block table and length of each request."""

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 page_size: int = PAGE_SIZE) -> None:
        if page_size <= 0:
            raise ConfigError(f"page size must be positive, got {page_size}")
        shape = (num_layers, num_pages + 1, page_size, num_kv_heads, head_dim)  # + scratch
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, P, S, Hkv, d]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.device = torch.device(device)
        self.allocator = PageAllocator(num_pages)
        self.scratch_slot = num_pages * page_size  # the first slot of the scratch page
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by page on dim 1 ([L, P + 1, ...]): what a page's data is."""
        return [self.k, self.v]

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
