"""Content hashes of full KV pages for automatic prefix caching (vLLM v1's block hash chain).

Page i of a sequence is named by `page_hash(parent, tokens)`: a 128-bit BLAKE2b digest of the
hash of page i - 1 (for page 0, `prefix_seed(...)` of everything else that changes what a page
holds: model, weights, dtypes, quantization, tp, page size) and the page's token ids. Equal
hashes mean equal token prefixes under the same model, so the KV of the page is the same and
requests may share it (models/kvcache.py `PageAllocator`: reference counts, the LRU of free
cached pages). Digests, unlike Python's `hash` of strings, are the same in every process.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

DIGEST_BYTES = 16


def prefix_seed(*parts: object) -> int:
    """The hash that page 0 chains from: a digest of `parts` (their `repr`s)."""
    text = "\x1f".join(repr(p) for p in parts).encode()
    return int.from_bytes(blake2b(text, digest_size=DIGEST_BYTES).digest(), "little")


def page_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of a full page holding `tokens`, after the page hashed `parent`."""
    h = blake2b(parent.to_bytes(DIGEST_BYTES, "little"), digest_size=DIGEST_BYTES)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def chain_hashes(seed: int, tokens: Sequence[int], page_size: int) -> list[int]:
    """The hash of every full page of `tokens` (a partial last page has none)."""
    out, parent = [], seed
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = page_hash(parent, tokens[start:start + page_size])
        out.append(parent)
    return out
