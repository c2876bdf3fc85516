"""The copy-engine all-reduce's stream order: its steps on modelled CUDA streams (a pull and a push
stream per peer, events, flags) run in random legal orders across ranks, back-to-back calls with
the next layer's writes queued behind them and slots reused, give the exact sum for every
sub-chunk count and on the caller's stream alone, and every side stream is joined back into the
caller's (as a CUDA graph capture needs); a transport that drops the push streams' forks is
caught (a wrong sum, or a deadlock)."""

from __future__ import annotations

import pytest
import torch

from nanosched.kernels.ce_allreduce import CopyEngineAllReduce, sub_ranges, subchunks_for
from tests.helpers.ce_streams import SimTransport, World

ROWS, WIDTHS = 16, (33, 3)  # fp32 buffers: chunks cut at 4-element boundaries
# (buffer, first row, end row): whole, one row, a middle slice, the last row; in the thin
# buffer tensors of fewer elements than ranks x 4 (ranks with an empty chunk)
CALLS = [(0, 0, 16), (1, 7, 8), (0, 3, 14), (1, 0, 2), (0, 15, 16), (1, 0, 16), (0, 2, 11),
         (0, 5, 6), (0, 0, 16)]


def _run(size: int, parts: int | None, seed: int, transport=SimTransport,
         one_stream: bool = False) -> list[bool]:
    world = World(size, seed)
    ranks = []
    for r in range(size):
        t = transport(r, world)
        ar = CopyEngineAllReduce(r, size, None, t, t.reduce, torch.device("cpu"),
                                 num_slots=3, num_subchunks=parts, one_stream=one_stream)
        ranks.append((t, ar, [ar.symmetric_zeros(ROWS, w, dtype=torch.float32)
                              for w in WIDTHS]))
    gen = torch.Generator().manual_seed(seed)
    data = [[torch.randint(-50, 50, (e - s, WIDTHS[b]), generator=gen).float()
             for _ in range(size)] for b, s, e in CALLS]
    got: dict[tuple[int, int], torch.Tensor] = {}
    for c, (b, s, e) in enumerate(CALLS):
        for r, (t, ar, bufs) in enumerate(ranks):  # the layer writes x, then reduces it
            x = bufs[b][s:e]
            t.on_s(lambda x=x, new=data[c][r]: x.copy_(new))
            ar.all_reduce(x)
            assert not t.unjoined(), (c, r, t.unjoined())
            t.on_s(lambda x=x, c=c, r=r: got.__setitem__((c, r), x.clone()))
    world.run()
    return [torch.equal(got[c, r], sum(data[c])) for c in range(len(CALLS))
            for r in range(size)]


@pytest.mark.parametrize("parts", [1, 2, 3, 4, None])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_any_stream_order_gives_the_sum(size, parts):
    for seed in range(6):
        assert all(_run(size, parts, seed)), (size, parts, seed)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_one_stream_gives_the_sum_in_any_order_across_ranks(size):
    for seed in range(6):
        assert all(_run(size, None, seed, one_stream=True)), (size, seed)


class _PushesUnordered(SimTransport):
    """Forgets to order the push streams after the reduction (forks into them dropped)."""

    def fork(self, src, dst) -> None:
        if dst in self.pushes:
            return
        super().fork(src, dst)


def _caught(seed: int) -> bool:
    try:
        return not all(_run(3, 2, seed, _PushesUnordered))
    except AssertionError:  # a signal lost to a flag written twice: the streams deadlock
        return True


def test_a_missing_fork_is_caught():
    assert any(_caught(seed) for seed in range(8))


@pytest.mark.parametrize("lo, hi, itemsize, parts, want", [
    (0, 100, 4, 4, [(0, 24), (24, 48), (48, 72), (72, 100)]),
    (8, 11, 4, 4, [(8, 11)]),  # fewer elements than the alignment step: one sub-chunk
    (4, 4, 2, 3, []),  # an empty chunk
    (16, 31, 2, 2, [(16, 31)]),  # 15 bf16 elements: the 8-element step leaves one
])
def test_sub_ranges_cover_the_chunk_aligned(lo, hi, itemsize, parts, want):
    assert sub_ranges(lo, hi, itemsize, parts) == want


def test_small_chunks_go_whole_and_large_ones_in_parts():
    assert subchunks_for(0) == 1 and subchunks_for(8 << 20) == 1 and subchunks_for(16 << 20) == 1
    assert subchunks_for(32 << 20) == 2 and subchunks_for(256 << 20) == 4
