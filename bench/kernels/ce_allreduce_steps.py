"""The copy-engine all-reduce alone, per rank (used by bench/kernels/ce_allreduce.py): is it
correct at every sub-chunk count, how long does it take at each, and what bounds it.

- `correct`: eager and inside a CUDA graph (three all-reduces of different row ranges, replayed
  on fresh data), each against NCCL's sum (relative error) and every rank bitwise equal.
- `alone`: median time of one all-reduce, each inside a graph of REPS calls, per T, per
  sub-chunk count and (by size only) per bound of the reduction's CTAs; NCCL likewise.
- `steps`: the call's parts, each in a graph of REPS: the round of one row (flags, forks and
  joins, a few bytes a peer: what every call pays whatever its size), the pulls alone (each
  peer's share of our chunk onto the pull streams, no flags), the pushes alone (our chunk to
  every peer), both at once (do the copy engines move more when pulls and pushes overlap, as
  sub-chunks make them?), and the reduction of the whole chunk; so pulls + reduction + pushes +
  one-row round against the call says what the pipelining hides, and the one-row round what
  bounds small T.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanosched.kernels.ce_allreduce import chunk_bounds
from nanosched.profiler.timing import captured, sustained_fixed

H = 8192
REPS = 10
SETTLE_S, WINDOW_S = 1.0, 2.0  # a sustained pair: the clock settles, then the window is timed


def collective_alone(fn: Any, stream: Any) -> tuple[Any, float, int, float | None]:
    """`fn` (one collective) captured in a graph on `stream`: the graph, its graph-timed time
    (the slowest rank's, us), the launches a sustained pair makes of it (settle + window, at
    least 40: every rank launches as many) and its sustained time alone (None: too few)."""
    g = captured(fn, stream)
    graph_us = max_over_ranks(time_graph_us(g, stream, 1))
    n = int(max(40, (SETTLE_S + WINDOW_S) * 1e6 / graph_us))
    dist.barrier()
    return g, graph_us, n, sustained_fixed(None, None, g.replay, stream, n, SETTLE_S).fixed_us


def net_alone_us(row: dict) -> float:
    """A pair row's collective alone: the faster of its graph-timed and sustained figures (a
    short collective's sustained loop can be bound by the host)."""
    return min(v for v in (row["net_alone_us"], row["net_graph_alone_us"]) if v)


def run_ranks(target: Any, world: int, extra: tuple, timeout_s: float, result: str) -> Any:
    """Run target(rank, world, port, *extra, folder) in `world` spawned processes (one per GPU,
    a TCP rendezvous on a free local port) and return the JSON that one of them wrote to
    folder/`result`. A rank that fails writes rank<r>.err there: the first is printed and the
    script exits 1; a rank still running after `timeout_s` is killed."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=target, args=(r, world, port, *extra, tmp))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout_s)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        errs = sorted(Path(tmp).glob("*.err"))
        if errs:
            print(errs[0].read_text(), file=sys.stderr)
            sys.exit(1)
        return json.loads(Path(tmp, result).read_text())


def record_path(out: str | None, fname: str) -> Path:
    """Where a record goes: --out (a folder, or a .json file), else $OUT, else bench/results."""
    path = Path(out or os.environ.get("OUT") or "bench/results")
    if path.suffix != ".json":
        path = path / fname
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def time_graph_us(g, stream, calls: int) -> float:
    """Median time of one of `calls` calls captured in `g`, over 15 replays."""
    times = []
    for _ in range(3):
        g.replay()
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record()
            g.replay()
            b.record()
        b.synchronize()
        times.append(1e3 * a.elapsed_time(b) / calls)
    return statistics.median(times)


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _compare(buf, s, e, ref, n, mode, parts) -> dict:
    got = buf[s:e].float()
    every = [torch.empty_like(got) for _ in range(n)]
    dist.all_gather(every, got)
    return {"rows": [s, e], "mode": mode, "subchunks": parts,
            "rel_err": float((got - ref).norm() / ref.norm()),
            "ranks_equal": all(torch.equal(every[0], t) for t in every)}


def correct(ar, buf, rank: int, n: int, parts: int | None) -> list[dict]:
    ar.num_subchunks = parts
    out = []
    for s, e in [(0, 1), (3, 10), (0, 512), (100, 2148), (0, buf.shape[0])]:
        torch.manual_seed(1000 * rank + s)
        buf[s:e].copy_(torch.randn(e - s, H, device="cuda"))
        ref = buf[s:e].float()
        dist.all_reduce(ref)
        ar.all_reduce(buf[s:e])
        torch.cuda.synchronize()
        out.append(_compare(buf, s, e, ref, n, "eager", parts))
    ranges = [(0, 256), (256, 1280), (1280, 3328)]
    stream = torch.cuda.Stream()
    torch.manual_seed(7 + rank)
    buf.copy_(torch.randn(buf.shape, device="cuda"))
    g = captured(lambda: [ar.all_reduce(buf[s:e]) for s, e in ranges], stream)
    for rep in range(3):
        torch.manual_seed(100 * rep + rank)
        buf.copy_(torch.randn(buf.shape, device="cuda"))
        refs = [buf[s:e].float() for s, e in ranges]
        for r in refs:
            dist.all_reduce(r)
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        out += [_compare(buf, s, e, ref, n, f"graph replay {rep}", parts)
                for (s, e), ref in zip(ranges, refs, strict=True)]
    ar.num_subchunks = None
    return out


def _graph_us(fn, stream) -> float:
    g = captured(lambda: [fn() for _ in range(REPS)], stream)
    dist.barrier()
    return max_over_ranks(time_graph_us(g, stream, REPS))


def alone(ar, buf, nccl_buf, ts, parts_list, bounds) -> list[dict]:
    """Per T: the copy engine at each sub-chunk count (None: by size) with the reduction
    unbounded, by size at each CTA bound, and NCCL."""
    stream = torch.cuda.Stream()
    rows = []
    for t in ts:
        for parts in parts_list:
            for bound in bounds if parts is None else [None]:
                us = _graph_us(lambda t=t, b=bound, p=parts: ar.all_reduce(
                    buf[:t], max_ctas=b, num_subchunks=p), stream)
                rows.append({"impl": "copy_engine", "T": t, "subchunks": parts,
                             "max_ctas": bound, "us": us})
        rows.append({"impl": "nccl", "T": t, "subchunks": None, "max_ctas": None,
                     "us": _graph_us(lambda t=t: dist.all_reduce(nccl_buf[:t]), stream)})
    return rows


def _copies(ar, buf, lo: int, hi: int, pull: bool, push: bool) -> None:
    """Elements [lo, hi) of `buf` from every peer onto the pull streams (pull) and/or to every
    peer on the push streams (push), no flags: the copy engines' time alone."""
    tr, item = ar.transport, buf.element_size()
    region, peers = ar._region(buf), [q for q in range(ar.size) if q != ar.rank]
    scratch, flat = ar._scratch[buf.dtype], buf.view(-1)
    s, pulls, pushes = tr.streams(peers)
    for i, q in enumerate(peers):
        peer = region.peer_ptrs[q] + lo * item
        for c, on in ((pulls[i], pull), (pushes[i], push)):
            if not on:
                continue
            tr.fork(s, c)
            if c is pulls[i]:
                tr.copy(c, scratch[i].data_ptr(), peer, (hi - lo) * item)
            else:
                tr.copy(c, peer, flat[lo:].data_ptr(), (hi - lo) * item)
            tr.fork(c, s)


def steps(ar, buf, ts) -> list[dict]:
    """The round of one row (what bounds small T); per T: the pulls alone, the pushes alone,
    both at once (what the pipelining can overlap), the reduction alone (us)."""
    from nanosched.kernels.reduce_sum import reduce_rows

    stream, item = torch.cuda.Stream(), buf.element_size()
    scratch, flat = ar._scratch[buf.dtype], buf.view(-1)
    rows = [{"step": "one row (flags, forks)", "T": 1,
             "us": _graph_us(lambda: ar.all_reduce(buf[:1]), stream)}]
    for t in ts:
        bounds = chunk_bounds(t * H, item, ar.size)
        lo, hi = bounds[ar.rank], bounds[ar.rank + 1]
        nbytes = (hi - lo) * item
        for name, pull, push in (("pulls", True, False), ("pushes", False, True),
                                 ("pulls + pushes at once", True, True)):
            rows.append({"step": name, "T": t, "bytes_per_peer": nbytes * (pull + push),
                         "us": _graph_us(lambda lo=lo, hi=hi, a=pull, b=push: _copies(
                             ar, buf, lo, hi, a, b), stream)})
        rows.append({"step": "reduction", "T": t, "us": _graph_us(
            lambda lo=lo, hi=hi: reduce_rows(flat[lo:hi], scratch[:, :hi - lo]), stream)})
    return rows
