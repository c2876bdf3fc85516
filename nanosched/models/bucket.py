"""Attention metadata of a CUDA-graph bucket: static device tensors, rewritten in place per batch.

A CUDA graph replays the same launches on the same pointers, so every batch it runs must be laid
out as the captured one was. A `Bucket` (D decode rows, T rows, S prefill segment slots, W pages
per block table) fixes that layout:

- rows [0, D) are decode rows: the batch's decode tokens, then padding;
- rows [D, T) are prefill rows: the batch's prompt chunks in order, then padding.

With cascade decode attention, the bucket also holds its decode rows' prefix groups: a fixed
`BUCKET_GROUPS` groups (models/cascade.py), the padding rows in one of prefix 0.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nanosched.errors import ConfigError
from nanosched.kernels.common import CascadeGroups, PrefillSegments, group_starts, segment_rows
from nanosched.models.batch import SeqChunk, TokenRange
from nanosched.models.cascade import BUCKET_GROUPS, decode_groups


def round_up(x: int, step: int) -> int:
    return -(-x // step) * step


def next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


@dataclass(frozen=True)
class Bucket:
    """Shape of a graph's batch: D decode rows, T rows, S prefill segment slots per slice, W
    block-table pages per request."""

    num_decode: int
    num_tokens: int
    num_segments: int
    max_pages: int

    @classmethod
    def for_chunks(cls, chunks: Sequence[SeqChunk], *, page_size: int, align: int,
                   max_tokens: int, max_pages: int, min_segments: int = 4) -> Bucket | None:
        """The bucket of a batch: decode rows rounded up to `align`, all rows rounded up to
        `align` (at most `max_tokens`), segment slots a power of two >= `min_segments`. None
        when the batch does not fit (more rows than `max_tokens` once the decode rows are
        rounded up, or a request longer than `max_pages` pages)."""
        nd = sum(c.is_decode for c in chunks)
        num_prefill = sum(c.num_tokens for c in chunks if not c.is_decode)
        d = min(round_up(nd, align), max_tokens)
        longest = max((c.first_pos + c.num_tokens for c in chunks), default=0)
        if d + num_prefill > max_tokens or -(-longest // page_size) > max_pages:
            return None
        t = min(round_up(d + num_prefill, align), max_tokens)
        segments = len(chunks) - nd
        s = max(min_segments, next_pow2(segments)) if num_prefill else 0
        return cls(d, t, s, max_pages)


class _Layout:
    """Host arrays of one batch laid out in a bucket (see the module docstring)."""

    def __init__(self, chunks: Sequence[SeqChunk], b: Bucket, page: int, scratch: int,
                 num_groups: int = 0) -> None:
        decode = [c for c in chunks if c.is_decode]
        prefill = [c for c in chunks if not c.is_decode]
        nd = len(decode)
        if nd > b.num_decode or any(c.is_decode for c in chunks[nd:]):
            raise ConfigError(f"{nd} decode tokens (first in the batch) do not fit the bucket's "
                              f"{b.num_decode} decode rows")
        if sum(c.num_tokens for c in prefill) > b.num_tokens - b.num_decode:
            raise ConfigError(f"{sum(c.num_tokens for c in prefill)} prompt tokens do not fit "
                              f"the bucket's {b.num_tokens - b.num_decode} prefill rows")
        if len(prefill) > b.num_segments:
            raise ConfigError(f"{len(prefill)} prompt chunks do not fit the bucket's "
                              f"{b.num_segments} segment slots")
        w = b.max_pages
        self.positions = np.zeros(b.num_tokens, dtype=np.int64)
        self.slots = np.full(b.num_tokens, scratch, dtype=np.int64)
        self.dec_tables = np.zeros((b.num_decode, w), dtype=np.int32)
        self.dec_lens = np.zeros(b.num_decode, dtype=np.int32)
        for i, c in enumerate(decode):
            table = _table(c, page, w)
            self.dec_tables[i, :len(table)] = table
            self.dec_lens[i] = c.first_pos + 1
            self.positions[i] = c.first_pos
            self.slots[i] = table[c.first_pos // page] * page + c.first_pos % page
        # prefix groups [G + 1] and [G] (with `num_groups`): the decode rows' groups, then one
        # of prefix 0 for the padded rows, then empty ones
        self.group_starts = np.zeros(num_groups + 1, dtype=np.int32)
        self.group_plens = np.zeros(num_groups, dtype=np.int32)
        if num_groups:
            rows, pages = decode_groups(self.dec_tables[:nd], self.dec_lens[:nd], page,
                                        num_groups - 1)
            self.group_starts[:] = group_starts([*rows, b.num_decode - nd], num_groups)
            self.group_plens[:len(pages)] = pages * page
        # prefill chunks: (first row, end row, first position, block table [W])
        self.chunks: list[tuple[int, int, int, np.ndarray]] = []
        row = b.num_decode
        for c in prefill:
            table = np.zeros(w, dtype=np.int32)
            pages = _table(c, page, w)
            table[:len(pages)] = pages
            pos = np.arange(c.first_pos, c.first_pos + c.num_tokens, dtype=np.int64)
            self.positions[row:row + c.num_tokens] = pos
            self.slots[row:row + c.num_tokens] = table[pos // page].astype(np.int64) * page \
                + pos % page
            self.chunks.append((row, row + c.num_tokens, c.first_pos, table))
            row += c.num_tokens

    def prefill_part(self, lo: int, hi: int, tables: np.ndarray, segs: np.ndarray) -> None:
        """Fill the tables [S, W] and segments [3, S] of the prefill rows [lo, hi)."""
        tables.fill(0)
        parts = []
        for first, end, pos, table in self.chunks:
            a, z = max(first, lo), min(end, hi)
            if a < z:
                tables[len(parts)] = table
                parts.append((a - lo, z - lo, pos + a - first))
        segs[...] = segment_rows(parts, segs.shape[1])


def _table(c: SeqChunk, page: int, w: int) -> np.ndarray:
    """The pages of `c` its attention reads (positions 0 .. first_pos + num_tokens - 1)."""
    need = -(-(c.first_pos + c.num_tokens) // page)
    if need > w:
        raise ConfigError(f"a request at position {c.first_pos + c.num_tokens - 1} needs {need} "
                          f"pages; the bucket's block tables hold {w}")
    return np.asarray(c.block_table[:need], dtype=np.int32)


class BucketMeta(TokenRange):
    """Static attention metadata of one bucket, or of one token range of it (`slice`)."""

    def __init__(self, bucket: Bucket, page_size: int, scratch_slot: int,
                 device: torch.device | str, *, cascade: bool = False,
                 _root: BucketMeta | None = None,
                 _range: tuple[int, int] | None = None) -> None:
        """`cascade`: hold the decode rows' prefix groups (`cascade_groups`)."""
        self.bucket, self.page_size, self.scratch_slot = bucket, page_size, scratch_slot
        self.device = torch.device(device)
        self.root = _root or self
        self.start, self.end = _range or (0, bucket.num_tokens)
        d = bucket.num_decode
        self.num_decode = max(0, min(self.end, d) - self.start)
        self.prefill_rows = (max(self.start, d), self.end)
        self._tables: torch.Tensor | None = None  # [S, W] int32 of the prefill part
        self._segs: torch.Tensor | None = None  # [3, S] int32
        if self.root is self:
            w = bucket.max_pages
            self._slices: dict[tuple[int, int], BucketMeta] = {}
            self._layout: _Layout | None = None
            self.frozen = False
            self._i64 = torch.zeros(2, bucket.num_tokens, dtype=torch.int64, device=device)
            self._dec_tables = torch.zeros(d, w, dtype=torch.int32, device=device)
            self._dec_lens = torch.zeros(d, dtype=torch.int32, device=device)
            self.num_groups = BUCKET_GROUPS if cascade and d else 0
            g = self.num_groups
            self._group_starts = torch.zeros(g + 1, dtype=torch.int32, device=device)
            self._group_plens = torch.zeros(g, dtype=torch.int32, device=device)
            self._host: tuple[torch.Tensor, torch.Tensor] | None = None
            self._i32: torch.Tensor | None = None
            self._copied: Any = None  # CUDA event behind the last H2D copy from pinned memory
        if self.num_prefill:
            self._tables = torch.zeros(bucket.num_segments, bucket.max_pages, dtype=torch.int32,
                                       device=device)
            self._segs = torch.zeros(3, bucket.num_segments, dtype=torch.int32, device=device)
            if self.root._layout is not None:
                self._fill_prefill()

    # ---- what the ops read (the BatchMeta interface) ---------------------------------------
    @property
    def positions(self) -> torch.Tensor:
        return self.root._i64[0, self.start:self.end]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.root._i64[1, self.start:self.end]

    @property
    def max_decode_context(self) -> int:
        return self.bucket.max_pages * self.page_size

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        s, nd = self.start, self.num_decode
        return self.root._dec_tables[s:s + nd], self.root._dec_lens[s:s + nd]

    def cascade_groups(self) -> CascadeGroups | None:
        """The decode rows' prefix groups (a bucket made with `cascade`, a range holding all
        its decode rows), with the bucket's bounds: its decode rows and its W pages."""
        root = self.root
        if not root.num_groups or self.start != 0 or self.end < self.bucket.num_decode:
            return None
        return CascadeGroups(root._group_starts, root._group_plens, self.bucket.num_decode,
                             self.bucket.max_pages * self.page_size)

    def prefill_block_tables(self) -> torch.Tensor:
        return self._tables

    def prefill_tensors(self) -> PrefillSegments:
        return PrefillSegments(self._segs)

    def slice(self, start: int, end: int) -> BucketMeta:
        """Metadata of the rows [start, end) (memoised by the bucket; none new once frozen)."""
        root = self.root
        if (start, end) == (root.start, root.end):
            return root
        if not root.start <= start <= end <= root.end:
            raise ConfigError(f"token range [{start}, {end}) is not inside the bucket's "
                              f"[0, {root.end})")
        got = root._slices.get((start, end))
        if got is None:
            if root.frozen:
                raise ConfigError(f"token range [{start}, {end}) was not used before the "
                                  f"bucket's graph was captured")
            got = root._slices[(start, end)] = BucketMeta(
                self.bucket, self.page_size, self.scratch_slot, self.device, _root=root,
                _range=(start, end))
        return got

    # ---- writing a batch -------------------------------------------------------------------
    def write(self, chunks: Sequence[SeqChunk]) -> None:
        """Lay the batch `chunks` (decode first) out in the bucket, on the current stream."""
        if self.root is not self:
            raise ConfigError("write a batch into the bucket's root metadata, not a slice")
        layout = _Layout(chunks, self.bucket, self.page_size, self.scratch_slot,
                         self.num_groups)
        self._layout = layout
        if not self.frozen:
            self._i64.copy_(torch.from_numpy(np.stack([layout.positions, layout.slots])))
            self._dec_tables.copy_(torch.from_numpy(layout.dec_tables))
            self._dec_lens.copy_(torch.from_numpy(layout.dec_lens))
            self._group_starts.copy_(torch.from_numpy(layout.group_starts))
            self._group_plens.copy_(torch.from_numpy(layout.group_plens))
            for m in self._parts():
                m._fill_prefill()
            return
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has read the pinned buffers
        h64, h32 = self._host
        h64.numpy()[:] = np.stack([layout.positions, layout.slots])
        self._fill_packed(h32.numpy())
        self._i64.copy_(h64, non_blocking=True)
        self._i32.copy_(h32, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def freeze(self) -> None:
        """Move every tensor into two packed device buffers (see the module docstring)."""
        if self.frozen:
            return
        parts = [self._dec_tables, self._dec_lens, self._group_starts, self._group_plens]
        parts += [t for m in self._parts() for t in (m._tables, m._segs)]
        size = sum(t.numel() for t in parts)
        self._i32 = torch.zeros(size, dtype=torch.int32, device=self.device)
        pin = self.device.type == "cuda"
        self._host = (torch.zeros(self._i64.shape, dtype=torch.int64, pin_memory=pin),
                      torch.zeros(size, dtype=torch.int32, pin_memory=pin))
        views, at = [], 0
        for t in parts:
            views.append(self._i32[at:at + t.numel()].view(t.shape))
            views[-1].copy_(t)
            at += t.numel()
        self._dec_tables, self._dec_lens = views[0], views[1]
        self._group_starts, self._group_plens = views[2], views[3]
        for k, m in enumerate(self._parts()):
            m._tables, m._segs = views[4 + 2 * k], views[5 + 2 * k]
        self.frozen = True

    def _parts(self) -> list[BucketMeta]:
        """The root and slices that have prefill rows, in a fixed order."""
        return [m for m in [self, *self._slices.values()] if m.num_prefill]

    def _fill_packed(self, n32: np.ndarray) -> None:
        """Fill the int32 buffer (laid out in `freeze`'s order) with the current layout."""
        lay, b = self._layout, self.bucket
        at = 0

        def take(*shape: int) -> np.ndarray:
            nonlocal at
            n = int(np.prod(shape))
            at += n
            return n32[at - n:at].reshape(shape)

        take(*lay.dec_tables.shape)[...] = lay.dec_tables
        take(*lay.dec_lens.shape)[...] = lay.dec_lens
        take(*lay.group_starts.shape)[...] = lay.group_starts
        take(*lay.group_plens.shape)[...] = lay.group_plens
        for m in self._parts():
            tables, segs = take(b.num_segments, b.max_pages), take(3, b.num_segments)
            lay.prefill_part(*m.prefill_rows, tables, segs)

    def _fill_prefill(self) -> None:
        b = self.bucket
        tables = np.zeros((b.num_segments, b.max_pages), dtype=np.int32)
        segs = np.zeros((3, b.num_segments), dtype=np.int32)
        self.root._layout.prefill_part(*self.prefill_rows, tables, segs)
        self._tables.copy_(torch.from_numpy(tables))
        self._segs.copy_(torch.from_numpy(segs))
