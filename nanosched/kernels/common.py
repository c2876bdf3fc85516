"""Small helpers shared by the Triton kernels: SM counts, dot precision, prefill segments, cascade
groups.

No triton import here, so the dispatcher and the models can use these on machines without triton.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanosched.errors import ConfigError

INTERPRET_NUM_SMS = 4  # stand-in SM count under TRITON_INTERPRET=1 (CPU tensors)
CTAS_PER_SM = 4  # default grid of a persistent memory-bound kernel, per SM
FP8_MAX = 448.0  # largest finite e4m3 (float8_e4m3fn) value
FP8_MIN_SCALE = 1e-12  # floor of a quantisation scale: an all-zero vector stays zero, not NaN


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the decode-attention partial kernel (kernels/decode_attn.py): tokens per
    loop step, software-pipelining depth (`num_stages` - 1 steps of K and V in flight per
    program; 1 = no pipelining), warps, and programs per SM when the caller bounds SMs (a
    partition's `num_sms`) but not CTAs."""

    block_n: int
    num_stages: int
    num_warps: int
    ctas_per_sm: int
    fp8_block_n: int | None = None  # tokens per step on an FP8 cache (None: block_n)

    def block_for(self, fp8: bool) -> int:
        """Tokens per loop step: an FP8 step of `fp8_block_n` tokens moves the bytes of a
        smaller bf16 one, and the kernel is bound per SM by the elements it converts and
        multiplies, so FP8 takes longer steps where that measured faster."""
        return (self.fp8_block_n or self.block_n) if fp8 else self.block_n

    def smem_bytes(self, head_dim: int, itemsize: int) -> int:
        """Shared memory of the K/V ring: what bounds the programs an SM can hold."""
        return 2 * max(1, self.num_stages - 1) * self.block_n * head_dim * itemsize


# `triton_paged`: one block of 32 tokens per step, loads not pipelined, four programs per SM.
PAGED = DecodeConfig(block_n=32, num_stages=1, num_warps=4, ctas_per_sm=CTAS_PER_SM)
# `triton_pipelined`: a deep page-load pipeline, so that few SMs keep enough bytes in flight;
# on an FP8 cache 128-token steps (H100, 640 requests x 1K-4K context, all SMs: 70-81% of copy
# against 59-67% with 64; bench/results/kernels_decode_attn-*-20261124T0155*.json).
PIPELINED = DecodeConfig(block_n=64, num_stages=4, num_warps=4, ctas_per_sm=2, fp8_block_n=128)
# `triton_pipelined_2w`: short steps on two warps, four programs per SM. Each step's softmax
# and P.V stay within fewer warps (fewer barriers in the per-step chain) and more programs run
# side by side: on an H100 partition of 32-48 SMs it reads 10-13% faster than PIPELINED at 256-640
# requests x 4-8K context, but slower on the whole GPU for small batches (64 requests, 1K:
# 40% of copy against 74%) (kernels_decode_attn-*-20261124T0235*.json). The profiler measures
# it, a co-run pair on a partition runs whichever attention kernel is fastest alone there, and
# its R->P point names it, so a replayed schedule launches it where it was measured.
PIPELINED_2W = DecodeConfig(block_n=32, num_stages=3, num_warps=2, ctas_per_sm=4)


def is_interpret() -> bool:
    """Whether Triton runs in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (INTERPRET_NUM_SMS for a CPU device)."""
    if device.type != "cuda":
        return INTERPRET_NUM_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact fp32 for fp32 inputs (no TF32), the default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (the models ask here instead of touching torch.cuda)."""
    return torch.cuda.is_available()


def bind_device(device: torch.device) -> None:
    """Make `device` the current CUDA device of this thread (Triton launches there).

    A bare "cuda" (no index) means the current device; torch.cuda.set_device refuses it.
    """
    if device.type == "cuda":
        torch.cuda.set_device(torch.cuda.current_device() if device.index is None
                              else device.index)


Segment = tuple[int, int, int]  # (start, end, first_pos) of one prefill segment


def host_to_device(values: Sequence[Any], dtype: torch.dtype,
                   device: torch.device | str) -> torch.Tensor:
    """A host sequence as a tensor on `device`, queued without waiting for the device: on a GPU
    through pinned memory. (`torch.tensor(values, device=...)` copies blocking, which
    synchronises the stream: a step that does so waits for every forward queued before it.) The
    caching host allocator keeps the pinned block until its copy has run."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class PrefillSegments:
    """Prefill segment metadata on the device, as the Triton prefill kernel reads it.

    `start`, `length`, `first_pos` [S] int32 are rows of one [3, S] tensor (`table`): segment i
    covers q rows start_i .. start_i + length_i - 1 at positions first_pos_i...; segments of
    length 0 are padding (a CUDA-graph bucket has a fixed S). `host` keeps the (start, end,
    first_pos) tuples when known, so the torch path needs no device read.
    """

    table: torch.Tensor  # [3, S] int32
    host: tuple[Segment, ...] | None = None

    @property
    def start(self) -> torch.Tensor:
        return self.table[0]

    @property
    def length(self) -> torch.Tensor:
        return self.table[1]

    @property
    def first_pos(self) -> torch.Tensor:
        return self.table[2]

    @property
    def num_segments(self) -> int:
        return self.table.shape[1]

    @classmethod
    def build(cls, segments: Sequence[Segment], device: torch.device | str,
              num_segments: int | None = None) -> PrefillSegments:
        """From (start, end, first_pos) tuples: one H2D copy, queued without waiting for the
        GPU (`host_to_device`); `num_segments` pads with empty segments."""
        table = host_to_device(segment_rows(segments, num_segments), torch.int32, device)
        return cls(table, tuple(tuple(s) for s in segments))

    def write(self, segments: Sequence[Segment]) -> PrefillSegments:
        """Copy new segments into these tensors in place (same S: a graph replays them); the
        rest is padding. Returns the metadata with the new host tuples."""
        self.table.copy_(torch.tensor(segment_rows(segments, self.num_segments),
                                      dtype=torch.int32))
        return PrefillSegments(self.table, tuple(tuple(s) for s in segments))

    def as_list(self) -> list[Segment]:
        """The non-empty segments as tuples (reads the device tensors when `host` is unknown)."""
        if self.host is not None:
            return list(self.host)
        starts, lens, first = self.table.tolist()
        return [(s, s + n, p) for s, n, p in zip(starts, lens, first, strict=True) if n > 0]


def padding(n: int, size: int | None, what: str) -> int:
    """How many empty entries pad `n` entries of `what` to a fixed `size` (None: n, no
    padding): a CUDA graph's metadata keeps its shape. ConfigError where n does not fit."""
    if size is not None and size < n:
        raise ConfigError(f"{n} {what} do not fit in {size}")
    return 0 if size is None else size - n


def segment_rows(segments: Sequence[Segment], num_segments: int | None = None) -> list[list[int]]:
    """[starts, lengths, first positions] of `segments`, padded with empty ones to
    `num_segments`."""
    for s, e, p in segments:
        if not 0 <= s <= e or p < 0:
            raise ConfigError(f"prefill segment {(s, e, p)} needs 0 <= start <= end and "
                              f"first_pos >= 0")
    pad = padding(len(segments), num_segments, "prefill segments")
    return [[s for s, _, _ in segments] + [0] * pad, [e - s for s, e, _ in segments] + [0] * pad,
            [p for _, _, p in segments] + [0] * pad]


def group_starts(rows: Sequence[int], num_groups: int | None = None) -> list[int]:
    """starts [G + 1] of groups of `rows[g]` rows each, in order, padded with empty groups to
    `num_groups` (None: no padding)."""
    starts = [0, *itertools.accumulate(int(r) for r in rows)]
    return starts + [starts[-1]] * padding(len(rows), num_groups, "cascade groups (num_groups)")


@dataclass(frozen=True)
class CascadeGroups:
    """The grouping on the device: starts [G+1] and prefix_lens [G] int32 (tokens, multiples of
    the page size). `max_rows` and `max_prefix_len` are host bounds (a CUDA-graph bucket's) on
    any group's rows and prefix: they size the prefix grid, never read the device."""

    starts: torch.Tensor  # [G + 1] int32
    prefix_lens: torch.Tensor  # [G] int32
    max_rows: int
    max_prefix_len: int

    @property
    def num_groups(self) -> int:
        return self.prefix_lens.shape[0]

    @classmethod
    def build(cls, rows: Sequence[int], prefix_lens: Sequence[int], page: int,
              device: torch.device | str, num_groups: int | None = None,
              max_rows: int | None = None, max_prefix_len: int | None = None) -> CascadeGroups:
        """From rows per group and prefix tokens per group (host lists): checked, copied without
        waiting for the GPU; `num_groups` pads with empty groups, the bounds default to the
        largest group and prefix."""
        if len(rows) != len(prefix_lens):
            raise ConfigError(f"cascade groups: {len(rows)} row counts but {len(prefix_lens)} "
                              "prefix lengths; give one of each per group")
        for g, (r, p) in enumerate(zip(rows, prefix_lens, strict=True)):
            if r < 0 or p < 0 or p % page:
                raise ConfigError(f"cascade group {g}: rows {r}, prefix_len {p}; rows >= 0 and "
                                  f"a prefix of whole pages of {page} tokens (a multiple of it)")
        starts = group_starts(rows, num_groups)
        pad = len(starts) - 1 - len(rows)
        max_rows = max(rows, default=0) if max_rows is None else max_rows
        max_prefix_len = max(prefix_lens, default=0) if max_prefix_len is None \
            else max_prefix_len
        if max_rows < max(rows, default=0) or max_prefix_len < max(prefix_lens, default=0):
            raise ConfigError(f"cascade groups: max_rows {max_rows} / max_prefix_len "
                              f"{max_prefix_len} below the largest group {max(rows)} / prefix "
                              f"{max(prefix_lens)}")
        return cls(host_to_device(starts, torch.int32, device),
                   host_to_device([*prefix_lens, *[0] * pad], torch.int32, device),
                   max_rows, max_prefix_len)
