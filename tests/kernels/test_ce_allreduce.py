"""The copy-engine all-reduce's slots, chunks, sub-chunks and flags, run by the host transport in
CPU processes over gloo: sums equal gloo's for every sub-chunk count and on one stream, odd row
counts, fewer rows than ranks and chunks left empty, every rank bitwise equal, rows outside the
reduced range untouched, slots reused past their count; the Triton reduction under the
interpreter."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist

from nanosched.kernels.ce_allreduce import CopyEngineAllReduce, chunk_bounds, reduce_reference
from nanosched.kernels.ce_transports import HostTransport
from nanosched.kernels.dispatch import triton_available
from nanosched.models.parallel import TensorParallel, launch

# (start row, end row) of a [64, 40] buffer (and of a [64, 3] one, where one row has fewer
# elements than ranks x 4: chunks left empty): whole, a slice, one row, odd counts and offsets
RANGES = [(0, 64), (8, 40), (63, 64), (5, 6), (17, 50), (0, 1), (1, 64)]
PARTS = [1, 2, 3, 4, None, "one stream"]  # sub-chunks per call (None: by size)


def _run(tp: TensorParallel, num_slots: int, rounds: int) -> list[dict]:
    torch.manual_seed(100 + tp.rank)
    transport = HostTransport(tp.rank, tp.size)
    ar = CopyEngineAllReduce(tp.rank, tp.size, None, transport, reduce_reference,
                             torch.device("cpu"), num_slots=num_slots)
    bufs = {(torch.float32, 40): ar.symmetric_zeros(64, 40, dtype=torch.float32),
            (torch.float16, 40): ar.symmetric_zeros(64, 40, dtype=torch.float16),
            (torch.float32, 3): ar.symmetric_zeros(64, 3, dtype=torch.float32)}
    out = []
    for i in range(rounds):
        dtype = torch.float32 if i % 3 else torch.float16
        width = 3 if i % 4 == 3 else 40
        s, e = RANGES[i % len(RANGES)]
        buf = bufs.get((dtype, width), bufs[dtype, 40])
        buf.copy_(torch.randn(buf.shape).to(dtype))
        before = buf.clone()
        want = buf[s:e].float().clone()  # .float() of fp32 is the buffer itself
        dist.all_reduce(want)
        parts = PARTS[i % len(PARTS)]
        if parts == "one stream":
            ar.all_reduce(buf[s:e], one_stream=True)
        else:
            ar.all_reduce(buf[s:e], num_subchunks=parts)
        got = buf[s:e].clone()
        every = [torch.empty_like(got) for _ in range(tp.size)]
        dist.all_gather(every, got)
        out.append({"err": float((got.float() - want).abs().max()),
                    "scale": float(want.abs().max()),
                    "ranks_equal": all(torch.equal(every[0], t) for t in every),
                    "outside_kept": torch.equal(torch.cat([buf[:s], buf[e:]]),
                                                torch.cat([before[:s], before[e:]])),
                    "dtype": str(dtype)})
    dist.barrier()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_host_all_reduce_sums_like_gloo(size):
    rounds = len(RANGES) * len(PARTS)  # every range with every sub-chunk count
    res = launch(_run, size, "gloo", 5, rounds)  # 5 slots: each reused about eight times
    assert len(res) == rounds
    for r in res:
        tol = 1e-5 if r["dtype"] == "torch.float32" else 2e-3
        assert r["err"] <= tol * max(1.0, r["scale"]), r
        assert r["ranks_equal"] and r["outside_kept"], r


@pytest.mark.parametrize("numel, itemsize, parts", [(1000, 2, 4), (7, 2, 4), (8192 * 5, 2, 3),
                                                    (64, 4, 2), (0, 2, 2)])
def test_chunks_cover_in_order_and_start_aligned(numel, itemsize, parts):
    b = chunk_bounds(numel, itemsize, parts)
    assert b[0] == 0 and b[-1] == numel and len(b) == parts + 1
    assert all(x <= y for x, y in itertools.pairwise(b))
    assert all(x * itemsize % 16 == 0 for x in b[:-1])


def test_a_tensor_outside_the_symmetric_buffers_is_refused():
    from nanosched.errors import ConfigError

    ar = CopyEngineAllReduce.__new__(CopyEngineAllReduce)
    ar.regions = []
    with pytest.raises(ConfigError, match="symmetric_zeros"):
        ar.all_reduce(torch.zeros(4))


@pytest.mark.parametrize("dtype, rows", [(torch.float32, 1), (torch.float32, 3),
                                         (torch.float16, 7)])
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
                    reason="needs triton and TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_triton_reduction_matches_the_reference(dtype, rows):
    from nanosched.kernels.reduce_sum import BLOCK, reduce_rows

    n = BLOCK * 2 + 37
    x = torch.randn(n).to(dtype)
    scratch = torch.randn(rows, n + 50).to(dtype)
    want = x.clone()
    reduce_reference(want, scratch[:, :n])
    reduce_rows(x, scratch[:, :n], max_ctas=2)
    torch.testing.assert_close(x, want, atol=2e-3, rtol=2e-3)
