"""What sending each iteration to the other tensor-parallel ranks costs (runtime/ranks/).

Three parts, each against the target of 2% of an iteration at the dense batch:
- host: rank 0 building and posting a `Step` for a batch of `--rows` decode rows (plus
  `--prefill-chunks` prompt chunks and a journal of one page reserved per 16 decodes, as a
  steady decode step has), through the shared-memory channel to `--tp` - 1 reader processes
  that decode it as a worker does (`Step.chunks()`); paced `--gap-ms` apart, so each reader
  sleeps in its semaphore as a worker between iterations does;
- reach: from the start of the post until the last reader has the batch decoded (the time a
  worker starts its launches after rank 0; the async loop hides it while it is shorter than
  the GPU's iteration);
- GPU: the broadcast of the batch's token ids (int64 [rows], `TensorParallel.broadcast`) over
  NCCL on `--tp` GPUs (gloo on the CPU), CUDA events around each, median.

Usage (GPU machine, repo root): `PYTHONPATH=. python bench/engine/tp_broadcast.py --tp 2 --rows
2048` (also `--tp 4`); `--device cpu` runs it with gloo. Writes bench-tp-broadcast-tp<N>.json to
$OUT or bench/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch

from bench._common import ROOT, environment, write_result  # noqa: F401 (ROOT: the checkout on sys.path)
from nanosched.runtime.ranks.channel import ChannelReader, ChannelWriter
from nanosched.runtime.ranks.messages import EngineLink


def reader(handle: Any, index: int, out: Any) -> None:
    """Receive until None; report when each message was decoded, by its index."""
    r = ChannelReader(handle, index)
    got = []
    while (msg := r.recv()) is not None:
        i, step = msg
        step.chunks()
        got.append((i, time.perf_counter()))
    r.close()
    out.put(got)


def batch_chunks(rows: int, prefill_chunks: int) -> tuple[list, list[bool]]:
    """A steady decode step as the engine hands it to `EngineLink.step`: `rows` decode chunks,
    then prompt chunks (the last one samples)."""
    chunks = [(i, 1, True) for i in range(rows)]
    chunks += [(rows + i, 512, False) for i in range(prefill_chunks)]
    return chunks, [True] * rows + [i == prefill_chunks - 1 for i in range(prefill_chunks)]


def host_costs(tp: int, rows: int, prefill_chunks: int, iters: int, gap_s: float
               ) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    writer = ChannelWriter(tp - 1)
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=reader, args=(writer.handle, i, out)) for i in range(tp - 1)]
    for p in procs:
        p.start()
    chunks, samples = batch_chunks(rows, prefill_chunks)
    starts: list[float] = []
    link = EngineLink(lambda m: writer.send((len(starts) - 1, m)), 0)
    post = []
    try:
        for i in range(iters):
            link.journal.extend(("reserve", r, 1000 + i) for r in range(i % 16, rows, 16))
            starts.append(time.perf_counter())
            link.step(chunks, samples, rows)
            post.append(time.perf_counter() - starts[-1])
            time.sleep(gap_s)
        writer.send(None)
        got = [dict(out.get()) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
        writer.close()
    reach = [max(g[i] for g in got) - starts[i] for i in range(iters)]
    skip = min(50, iters // 10)  # the first iterations warm the readers up
    return {"message_bytes": link.bytes_sent // iters, **_stats("post_us", post[skip:]),
            **_stats("reach_us", reach[skip:])}


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    s = sorted(seconds)
    return {f"{name}_median": 1e6 * statistics.median(s), f"{name}_p90": 1e6 * s[9 * len(s) // 10]}


def broadcast_rank(tp: Any, rows: int, iters: int, cuda: bool) -> dict[str, float]:
    """Time `tp.broadcast` of int64 [rows] on this rank (rank 0's figures are returned)."""
    device = torch.device("cuda", tp.rank) if cuda else torch.device("cpu")
    x = torch.arange(rows, dtype=torch.int64, device=device)
    times = []
    for i in range(iters + 20):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            tp.broadcast(x)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            tp.broadcast(x)
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 20:
            times.append(ms / 1e3)
    return _stats("token_broadcast_us", times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--prefill-chunks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    from nanosched.constants import MULTICAST_OFF
    from nanosched.models.parallel import launch

    os.environ.update(MULTICAST_OFF)
    cuda = args.device == "cuda"
    env = environment() if cuda else {
        "device": "cpu", "torch": torch.__version__, "python": platform.python_version(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv])}
    out: dict[str, Any] = {"env": env | {"cpu_count": os.cpu_count()}, "tp": args.tp,
                           "rows": args.rows, "prefill_chunks": args.prefill_chunks,
                           "iters": args.iters, "gap_ms": args.gap_ms}
    out |= host_costs(args.tp, args.rows, args.prefill_chunks, args.iters, args.gap_ms / 1e3)
    out |= launch(broadcast_rank, args.tp, "nccl" if cuda else "gloo", args.rows,
                  min(args.iters, 500), cuda)
    path = write_result(f"tp-broadcast-tp{args.tp}", out)
    for k, v in out.items():
        if k != "env":
            print(f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
