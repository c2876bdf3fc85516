"""Where a batch's chunks sit in the forward's rows, and which rows sample.

Decode chunks come first, one row each; with a CUDA-graph bucket (models/bucket.py) the prompt
chunks start at the bucket's first prefill row (the decode rows are padded up to it) and the
forward runs the bucket's rows, else they follow the decode rows and the forward runs the
batch's. Every rank of a tensor-parallel engine computes the same layout from the same chunks:
rank 0 to place the token ids (`write_token_ids`), the others to run the same forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanosched.kernels.common import host_to_device
from nanosched.models.batch import SeqChunk
from nanosched.models.bucket import Bucket


@dataclass(frozen=True)
class Layout:
    bucket: Bucket | None
    num_rows: int  # rows the forward runs: the bucket's, else the batch's tokens
    prefill_row: int  # the first prompt row
    starts: list[int]  # each chunk's first row
    rows: list[int]  # the rows that sample (a decode, or the last row of a prompt's last chunk)
    segments: list[tuple[int, int, bool]]  # (first row, end row, is_decode) per chunk


def lay_out(seqs: Sequence[SeqChunk], samples: Sequence[bool], bucket: Bucket | None) -> Layout:
    """The rows of `seqs` (decode first); `samples[i]`: whether chunk i yields a token."""
    num_decode = sum(c.is_decode for c in seqs)
    prefill_row = bucket.num_decode if bucket else num_decode
    num_rows = bucket.num_tokens if bucket else sum(c.num_tokens for c in seqs)
    starts, rows, segments, row = [], [], [], 0
    for c, s in zip(seqs, samples, strict=True):
        if not c.is_decode and row < prefill_row:
            row = prefill_row
        end = row + c.num_tokens
        starts.append(row)
        segments.append((row, end, c.is_decode))
        if s:
            rows.append(end - 1)
        row = end
    return Layout(bucket, num_rows, prefill_row, starts, rows, segments)


def write_token_ids(token_ids: torch.Tensor, entries: Sequence[Any], lay: Layout,
                    in_flight_row: dict[int, int], in_flight: torch.Tensor | None) -> None:
    """Write a batch's input token ids into its rows of `token_ids` (the workspace's): a
    prompt chunk's from its prompt, a decode's from its last output, or, while that token is
    still in flight on the device (async loop), from row `in_flight_row[id]` of `in_flight`.
    Host values go through pinned memory, so nothing waits for the forward in flight."""
    dev = token_ids.device
    ids, from_device = [0] * lay.num_rows, []
    for e, row in zip(entries, lay.starts, strict=True):
        r = e.request
        if e.is_decode and r.pending:
            from_device.append((row, in_flight_row[r.request_id]))
        elif e.is_decode:
            ids[row] = r.output_ids[-1]
        else:
            ids[row:row + e.num_tokens] = r.prefill_ids(e.start, e.num_tokens)
    token_ids[:lay.num_rows].copy_(host_to_device(ids, torch.int64, dev))
    if from_device:
        dst, src = zip(*from_device, strict=True)
        token_ids.index_copy_(0, host_to_device(dst, torch.int64, dev),
                              in_flight[host_to_device(src, torch.int64, dev)])
