"""The copy-engine all-reduce on two (and four) GPUs against NCCL: eager, and replayed from a
CUDA graph on fresh data (flags, copies and the reduction captured: two slices in one graph,
and the whole buffer in another), every rank bitwise equal;
whole chunks, chunks pipelined in sub-chunks (1, 3, and by size: [2048, 4096] bf16 at tp = 2
is 8 MiB a chunk, whole) and every step on the caller's stream ("one stream")."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from nanosched.constants import MULTICAST_OFF
from nanosched.models.parallel import TensorParallel, launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

os.environ.update(MULTICAST_OFF)  # multicast stays off (shared hosts)

RANGES = [(0, 1), (3, 130), (130, 1154), (0, 2048)]
GRAPH_REPLAYS = 3
CHECKS = len(RANGES) + GRAPH_REPLAYS * 3  # eager; two slices a replay, then the whole buffer


def _check(tp: TensorParallel, impl: str, parts: int | str | None) -> list[dict]:
    device = torch.device("cuda", tp.rank)
    tp = tp.with_copy_engine(device)
    if parts == "one stream":
        tp.copy_engine.one_stream = True
    else:
        tp.copy_engine.num_subchunks = parts
    buf = tp.symmetric_zeros(2048, 4096, dtype=torch.bfloat16, device=device)
    out = []

    def compare(s: int, e: int, ref: torch.Tensor, mode: str) -> None:
        got = buf[s:e].float()
        every = [torch.empty_like(got) for _ in range(tp.size)]
        dist.all_gather(every, got)
        out.append({"mode": mode, "rows": (s, e),
                    "rel": float((got - ref).norm() / ref.norm()),
                    "equal": all(torch.equal(every[0], x) for x in every)})

    for s, e in RANGES:
        torch.manual_seed(10 * tp.rank + s)
        buf[s:e].normal_()
        ref = buf[s:e].float()
        dist.all_reduce(ref)
        tp.all_reduce(buf[s:e], impl)
        torch.cuda.synchronize()
        compare(s, e, ref, "eager")
    for name, ranges in (("graph", RANGES[1:3]), ("whole graph", RANGES[3:])):
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.graph(graph, stream=side):
            for s, e in ranges:
                tp.all_reduce(buf[s:e], impl)
        for rep in range(GRAPH_REPLAYS):
            buf.normal_(generator=torch.Generator(device).manual_seed(100 * rep + tp.rank))
            refs = [buf[s:e].float() for s, e in ranges]
            for ref in refs:
                dist.all_reduce(ref)
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            for (s, e), ref in zip(ranges, refs, strict=True):
                compare(s, e, ref, f"{name} {rep}")
    return out


@pytest.mark.parametrize("impl, parts", [("copy_engine", 1), ("copy_engine", 3),
                                         ("copy_engine", None), ("copy_engine_ctas8", None),
                                         ("copy_engine", "one stream")])
def test_copy_engine_all_reduce_equals_nccl_eager_and_in_graphs(impl, parts):
    res = launch(_check, 2, "nccl", impl, parts)
    assert len(res) == CHECKS
    for r in res:
        assert r["rel"] < 1e-2 and r["equal"], r


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
@pytest.mark.parametrize("parts", [1, None, "one stream"])
def test_copy_engine_all_reduce_on_four_gpus(parts):
    res = launch(_check, 4, "nccl", "copy_engine_ctas16", parts)
    assert len(res) == CHECKS
    for r in res:
        assert r["rel"] < 1e-2 and r["equal"], r
