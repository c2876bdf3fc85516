"""Prefix groups of a batch's decode rows, for cascade decode attention (kernels/cascade_attn.py).

Prefix caching gives requests that share a prompt prefix the same physical pages at the start of
their block tables. A group is a run of consecutive decode rows with the same first page and at
least two rows; its prefix is the pages all its rows' tables share from the start, in whole
pages, never a row's last (partially written) page, so every row keeps at least its own token
past the prefix. A run with no such page is no group. The groups, and the rows between them as
groups of prefix 0, partition the rows, as `CascadeGroups` wants. The request scheduler puts the
decode rows of one first page side by side (`group_order`); here only consecutive rows group, so
any order stays correct. Host numpy, vectorised over the rows: it runs every iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from nanosched.errors import ConfigError
from nanosched.kernels.impls import CASCADE_DECODE

# groups of a CUDA-graph bucket (prefix groups + the rows of prefix 0): fixed at capture; rows
# of further groups join the last group, of prefix 0 (they attend by the ordinary path's sums)
BUCKET_GROUPS = 32


def uses_cascade(model: Any) -> bool:
    """Whether `model`'s kernel options ask for cascade decode attention (--decode-attention)."""
    return getattr(getattr(model, "kernels", None), "decode_impl", None) == CASCADE_DECODE


def decode_groups(tables: np.ndarray, lens: np.ndarray, page: int,
                  max_groups: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows per group, prefix pages per group) of decode rows with block tables [n, W] and
    context lengths [n] (the current token included): groups in row order that partition the n
    rows, each a prefix group or a run of rows of prefix 0. At most `max_groups` groups: past
    it, the rest of the rows is one group of prefix 0."""
    n = lens.shape[0]
    if tables.ndim != 2 or tables.shape[0] != n:
        raise ConfigError(f"cascade grouping: block tables {tables.shape} must be [{n}, pages] "
                          f"beside {n} context lengths")
    if max_groups is not None and max_groups < 1:
        raise ConfigError(f"cascade grouping: max_groups {max_groups} must be at least 1")
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    width = tables.shape[1]
    first = tables[:, 0]
    is_head = np.ones(n, dtype=bool)
    is_head[1:] = first[1:] != first[:-1]
    heads = np.flatnonzero(is_head)  # first row of each run of one first page
    sizes = np.diff(np.append(heads, n))
    head_of = np.repeat(heads, sizes)
    limit = np.maximum(lens.astype(np.int64) - 1, 0) // page  # pages before a row's last one
    same = (tables == tables[head_of]) & (np.arange(width) < limit[:, None])  # [n, W]
    match = np.where(same.all(axis=1), width, same.argmin(axis=1))  # leading shared pages
    pages = np.minimum.reduceat(match, heads)
    grouped = (sizes > 1) & (pages > 0)
    # a group starts at each prefix group and at the first of each stretch of other runs
    opens = grouped.copy()
    opens[0] = True
    opens[1:] |= grouped[:-1]
    at = np.flatnonzero(opens)
    rows = np.add.reduceat(sizes, at)
    prefix = np.where(grouped[at], pages[at], 0)
    if max_groups is not None and len(rows) > max_groups:
        rest = rows[max_groups - 1:].sum()
        rows = np.append(rows[:max_groups - 1], rest)
        prefix = np.append(prefix[:max_groups - 1], 0)
    return rows, prefix


def group_order(first_pages: Sequence[int]) -> list[int]:
    """An order of decode rows by first page (`first_pages[i]` of row i) that puts the rows of a
    page shared by several first, side by side, and the rest after them, each in its order."""
    first = np.asarray(first_pages, dtype=np.int64)
    _, inverse, counts = np.unique(first, return_inverse=True, return_counts=True)
    return np.lexsort((first, counts[inverse] < 2)).tolist()  # stable: ties keep their order

