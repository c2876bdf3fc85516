"""Expected remaining output of a running request, from the outputs of requests that ended.

NanoFlow (§4.2.1) admits by the peak KV memory predicted from the expected decode length. The
"predict" admission policy (runtime/request_scheduler.py) needs, for a request that has
generated n tokens and may generate up to m, how many more it will: the empirical conditional mean
E[L - n | L > n] over the output lengths L of the last `window` requests that ended, capped at
m - n. It is exact when every request generates the same length (a benchmark: L = max_tokens
gives max_tokens - n, the "reserve" bound), right for memoryless lengths (a constant), and falls
back to m - n (the conservative bound) before any request ended or when no length seen so far
exceeds n. Lengths are integers; a query is a binary search and a suffix sum.
"""

from __future__ import annotations

import bisect
from collections import deque


class OutputLengths:
    """Output lengths of ended requests (a sliding window) and the expected remainder."""

    def __init__(self, window: int = 1024) -> None:
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: list[int] | None = None  # sorted copy of `_recent`, rebuilt lazily
        self._suffix: list[int] = []  # suffix sums of `_sorted`

    def __len__(self) -> int:
        return len(self._recent)

    def record(self, length: int) -> None:
        """An ended request generated `length` tokens."""
        self._recent.append(length)
        self._sorted = None

    def _tables(self) -> tuple[list[int], list[int]]:
        if self._sorted is None:
            self._sorted = sorted(self._recent)
            self._suffix = [0] * (len(self._sorted) + 1)
            for i in range(len(self._sorted) - 1, -1, -1):
                self._suffix[i] = self._suffix[i + 1] + self._sorted[i]
        return self._sorted, self._suffix

    def remaining(self, generated: int, max_tokens: int) -> int:
        """Expected tokens still to come for a request at `generated` of `max_tokens`
        (rounded up; at most max_tokens - generated)."""
        cap = max(0, max_tokens - generated)
        lengths, suffix = self._tables()
        i = bisect.bisect_right(lengths, generated)  # lengths[i:] > generated
        longer = len(lengths) - i
        if longer == 0:
            return cap
        mean_rest = -(-(suffix[i] - generated * longer) // longer)
        return min(cap, mean_rest)
