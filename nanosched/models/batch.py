"""Attention metadata of a dense batch, sliceable to any token range [start, end).

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from nanosched.errors import ConfigError
from nanosched.kernels.common import CascadeGroups, PrefillSegments, host_to_device
from nanosched.models.cascade import decode_groups


@dataclass(frozen=True)
class SeqChunk:
    """One request's tokens in a batch: positions first_pos .. first_pos + num_tokens - 1."""

    block_table: tuple[int, ...]  # cache pages of the request, covering every position written
    first_pos: int
    num_tokens: int
    is_decode: bool


class TokenRange:
    """The token counts of a range [start, end) whose first `num_decode` tokens are decode
    tokens (shared by `BatchMeta` and the CUDA-graph `BucketMeta`)."""

    start: int
    end: int
    num_decode: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_prefill(self) -> int:
        return self.num_tokens - self.num_decode


@dataclass(eq=False)
class BatchMeta(TokenRange):
    """Attention metadata for the tokens [start, end) of a dense batch (see module docstring)."""

    start: int
    end: int
    num_decode: int
    page_size: int
    positions: torch.Tensor  # [n] int64
    slot_mapping: torch.Tensor  # [n] int64
    block_tables: torch.Tensor  # [num_segments, max_pages] int32
    context_lens: torch.Tensor  # [num_segments] int32
    seg_starts: tuple[int, ...]
    seg_ends: tuple[int, ...]
    seg_first_pos: tuple[int, ...]
    seg_request: tuple[int, ...]
    context_lens_cpu: tuple[int, ...]
    _slices: dict[tuple[int, int], BatchMeta] = field(default_factory=dict, repr=False)
    _prefill: PrefillSegments | None = field(default=None, repr=False)
    _groups: CascadeGroups | None = field(default=None, repr=False)

    @property
    def max_decode_context(self) -> int:
        """Longest decode context in the range (0 when there are no decode tokens)."""
        return max(self.context_lens_cpu[: self.num_decode], default=0)

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables, context lengths) of the range's decode tokens, one row each."""
        nd = self.num_decode
        return self.block_tables[:nd], self.context_lens[:nd]

    def cascade_groups(self) -> CascadeGroups | None:
        """The decode rows' prefix groups (models/cascade.py), when built with `cascade` and
        some rows share a page; None otherwise and for a range without all the decode rows."""
        return self._groups

    def prefill_block_tables(self) -> torch.Tensor:
        """Block tables of the range's prefill segments, in `prefill_tensors()` order."""
        return self.block_tables[self.num_decode:]

    def prefill_segments(self) -> list[tuple[int, int, int]]:
        """(start, end, first_pos) of each prefill segment, relative to the first prefill token."""
        nd = self.num_decode
        return [(s - nd, e - nd, p) for s, e, p in
                zip(self.seg_starts[nd:], self.seg_ends[nd:], self.seg_first_pos[nd:],
                    strict=True)]

    def prefill_tensors(self) -> PrefillSegments:
        """`prefill_segments()` as device tensors (one H2D copy when the metadata is built, then
        memoised: a CUDA graph capture needs no copy)."""
        if self._prefill is None:
            self._prefill = PrefillSegments.build(self.prefill_segments(), self.positions.device)
        return self._prefill

    @classmethod
    def build(cls, chunks: Sequence[SeqChunk], page_size: int,
              device: torch.device | str = "cpu", cascade: bool = False) -> BatchMeta:
        """Metadata of a full batch whose segments are `chunks`, decode chunks first; with
        `cascade`, the decode rows' prefix groups too (`cascade_groups`)."""
        _check_chunks(chunks, page_size)
        positions, slots, starts, ends = [], [], [], []
        for c in chunks:
            starts.append(len(positions))
            for p in range(c.first_pos, c.first_pos + c.num_tokens):
                positions.append(p)
                slots.append(c.block_table[p // page_size] * page_size + p % page_size)
            ends.append(len(positions))
        width = max((len(c.block_table) for c in chunks), default=1) or 1
        tables = [list(c.block_table) + [0] * (width - len(c.block_table)) for c in chunks]
        lens = tuple(c.first_pos + c.num_tokens for c in chunks)
        num_decode = sum(c.is_decode for c in chunks)
        groups = _groups(tables[:num_decode], lens[:num_decode], page_size, device) \
            if cascade else None
        return _with_prefill(cls(
            start=0, end=len(positions), num_decode=num_decode,
            page_size=page_size,
            positions=host_to_device(positions, torch.int64, device),
            slot_mapping=host_to_device(slots, torch.int64, device),
            block_tables=host_to_device(tables, torch.int32, device).view(-1, width),
            context_lens=host_to_device(lens, torch.int32, device),
            seg_starts=tuple(starts), seg_ends=tuple(ends),
            seg_first_pos=tuple(c.first_pos for c in chunks),
            seg_request=tuple(range(len(chunks))), context_lens_cpu=lens, _groups=groups))

    def slice(self, start: int, end: int) -> BatchMeta:
        """Metadata of the global token range [start, end) ⊆ [self.start, self.end)."""
        if (start, end) == (self.start, self.end):
            return self
        if not self.start <= start <= end <= self.end:
            raise ConfigError(f"token range [{start}, {end}) is not inside the batch range "
                              f"[{self.start}, {self.end})")
        if (start, end) not in self._slices:
            self._slices[(start, end)] = self._make_slice(start, end)
        return self._slices[(start, end)]

    def _make_slice(self, start: int, end: int) -> BatchMeta:
        rows, starts, ends, first_pos = [], [], [], []
        for i, (s, e, p) in enumerate(zip(self.seg_starts, self.seg_ends, self.seg_first_pos,
                                          strict=True)):
            lo, hi = max(s + self.start, start), min(e + self.start, end)
            if lo < hi:
                rows.append(i)
                starts.append(lo - start)
                ends.append(hi - start)
                first_pos.append(p + lo - (s + self.start))
        lens = tuple(p + e - s for s, e, p in zip(starts, ends, first_pos, strict=True))
        device = self.positions.device
        index = host_to_device(rows, torch.int64, device)
        a, b = start - self.start, end - self.start
        return _with_prefill(BatchMeta(
            start=start, end=end, num_decode=sum(r < self.num_decode for r in rows),
            page_size=self.page_size, positions=self.positions[a:b],
            slot_mapping=self.slot_mapping[a:b],
            block_tables=self.block_tables.index_select(0, index),
            context_lens=host_to_device(lens, torch.int32, device),
            seg_starts=tuple(starts), seg_ends=tuple(ends), seg_first_pos=tuple(first_pos),
            seg_request=tuple(self.seg_request[r] for r in rows), context_lens_cpu=lens,
            _groups=self._groups if start == self.start and b >= self.num_decode else None))


def _groups(tables: list[list[int]], lens: Sequence[int], page: int,
            device: torch.device | str) -> CascadeGroups | None:
    """The prefix groups of decode rows (tables padded to one width), None without any."""
    if len(lens) < 2:
        return None
    rows, pages = decode_groups(np.asarray(tables, dtype=np.int32),
                                np.asarray(lens, dtype=np.int32), page)
    if not pages.any():
        return None
    return CascadeGroups.build(rows.tolist(), (pages * page).tolist(), page, device)


def _with_prefill(meta: BatchMeta) -> BatchMeta:
    """`meta` with its device prefill segments built now (when it has prefill tokens): metadata
    made before a CUDA-graph capture then needs no H2D copy inside it."""
    if meta.num_prefill:
        meta.prefill_tensors()
    return meta


def _check_chunks(chunks: Sequence[SeqChunk], page_size: int) -> None:
    if page_size <= 0:
        raise ConfigError(f"page size must be positive, got {page_size}")
    seen_prefill = False
    for i, c in enumerate(chunks):
        if c.num_tokens <= 0 or c.first_pos < 0:
            raise ConfigError(f"chunk {i}: num_tokens must be positive and first_pos >= 0, got "
                              f"{c.num_tokens} and {c.first_pos}")
        if c.is_decode and (seen_prefill or c.num_tokens != 1):
            raise ConfigError(f"chunk {i}: decode chunks have one token and come before every "
                              f"prefill chunk")
        seen_prefill = seen_prefill or not c.is_decode
        needed = -(-(c.first_pos + c.num_tokens) // page_size)
        if len(c.block_table) < needed:
            raise ConfigError(f"chunk {i}: block table has {len(c.block_table)} pages, positions "
                              f"up to {c.first_pos + c.num_tokens - 1} need {needed}")
