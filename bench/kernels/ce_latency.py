"""Where the copy-engine all-reduce's fixed cost goes: the steps of a one-row call, timed apart.

GPU, one process per GPU (N = all visible, or --world). A one-row all-reduce
(nanosched.kernels.ce_allreduce) costs about 100 us on 4xH100 whatever it moves: that, not the
copy engines' bandwidth, is what makes it slower than NCCL's below a few MB. Each variant below
is REPS calls captured in one CUDA graph on the caller's stream S, timed per call (median of
replays, the slowest rank's), so it is the GPU's cost of the pattern inside a graph, as the
engine replays it:

  kernel                one tiny kernel on S (a graph's cost per dependent node)
  memop own             write 1 to our own flag, wait for it, reset it (stream memory operations)
  kernel+memop          the tiny kernel, then the memop step: a switch of engine on S
  flag round            write the ready flag of every peer, wait for every peer's (one
                        cross-GPU round trip, on S only)
  peer copy on S        one 16-byte copy from a peer's buffer on S
  kernel+peer copy      the tiny kernel then that copy, on S (compute -> copy engine -> compute)
  fork+copy+join        the copy on a forked stream per peer, joined back (the call's shape)
  fork+join             the forks and joins alone, a memop on each branch (nothing copied)
  all-reduce 1 row      the call itself (K = 1), the reduction's kernel included
  all-reduce 1 row, no reduction  the same steps with the reduction skipped (flags, pulls,
                        pushes, forks: the copy engines' and the flags' share)
  all-reduce 1 row, one stream    every step on S (`one_stream`): no forks, copies in series

Then per T rows of [T, 8192] bf16: the all-reduce with a pull and a push stream per peer (whole
chunks), on one stream, and NCCL's, each alone in graphs; and the one-stream result against
NCCL's (relative error, every rank bitwise equal).

Writes ce_latency-<GPU>-<N>gpu-<stamp>.json to --out, else $OUT, else bench/results/; prints
the table last. Run: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  PYTHONPATH=. python bench/kernels/ce_latency.py [--world 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

from nanosched.constants import MULTICAST_OFF

os.environ.update(MULTICAST_OFF)  # before torch and NCCL load

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.kernels.ce_allreduce_steps import (  # noqa: E402
    H,
    max_over_ranks,
    record_path,
    run_ranks,
    time_graph_us,
)
from nanosched.kernels.ce_allreduce import DONE, READY  # noqa: E402
from nanosched.profiler.timing import captured  # noqa: E402

REPS = 50  # calls a graph: its launch is amortised below a microsecond a call
TS = (1, 16, 128, 512, 1024, 2048)


def _no_reduce(x, scratch, max_ctas=None) -> None:
    """The reduction skipped: what the call costs without its SM step."""


def variants(ar, buf) -> dict:
    """name -> the step of one call (module docstring); each takes its own flag slot."""
    tr, flags, r = ar.transport, ar._flags, ar.rank
    peers = [q for q in range(ar.size) if q != r]
    region = ar.regions[0]
    tiny = torch.zeros(1, device=buf.device)
    _, pulls, _ = tr.streams(peers)
    src = [region.peer_ptrs[q] for q in peers]  # row 0 of each peer's buffer, seen from here
    dst = ar._scratch[buf.dtype]

    def kernel():
        tiny.add_(1.0)

    def memop_own():
        slot = ar._take_slot()
        addr = ar._flag(flags.ptr, DONE, slot, r)
        s = torch.cuda.current_stream()
        tr.write_flag(s, addr)
        tr.wait_flag(s, addr)

    def flag_round():
        slot, s = ar._take_slot(), torch.cuda.current_stream()
        for q in peers:
            tr.write_flag(s, ar._flag(flags.peer_ptrs[q], READY, slot, r))
        for q in peers:
            tr.wait_flag(s, ar._flag(flags.ptr, READY, slot, q))

    def peer_copy():
        tr.copy(torch.cuda.current_stream(), dst[0].data_ptr(), src[0], 16)

    def fork_copy_join(copy: bool):
        s = torch.cuda.current_stream()
        slot = ar._take_slot()
        for i in range(len(peers)):
            tr.fork(s, pulls[i])
            if copy:
                tr.copy(pulls[i], dst[i].data_ptr(), src[i], 16)
            else:  # a node on the branch, so the fork and join are not empty edges
                addr = ar._flag(flags.ptr, DONE, slot, peers[i])
                tr.write_flag(pulls[i], addr)
                tr.wait_flag(pulls[i], addr)
            tr.fork(pulls[i], s)

    def all_reduce(reduce: bool):
        def step():
            keep = ar.reduce
            if not reduce:
                ar.reduce = _no_reduce
            try:
                ar.all_reduce(buf[:1], num_subchunks=1)
            finally:
                ar.reduce = keep
        return step

    return {
        "kernel": kernel,
        "memop own": memop_own,
        "kernel+memop": lambda: (kernel(), memop_own()),
        "flag round": flag_round,
        "peer copy on S": peer_copy,
        "kernel+peer copy": lambda: (kernel(), peer_copy()),
        "fork+copy+join": lambda: fork_copy_join(True),
        "fork+join": lambda: fork_copy_join(False),
        "all-reduce 1 row": all_reduce(True),
        "all-reduce 1 row, no reduction": all_reduce(False),
        "all-reduce 1 row, one stream": lambda: ar.all_reduce(buf[:1], one_stream=True),
    }


def sizes(ar, buf, nccl_buf, stream) -> list[dict]:
    """Per T: per-peer streams, one stream and NCCL alone (us per call, slowest rank)."""
    impls = {"per-peer streams": lambda t: ar.all_reduce(buf[:t], num_subchunks=1),
             "one stream": lambda t: ar.all_reduce(buf[:t], one_stream=True),
             "nccl": lambda t: dist.all_reduce(nccl_buf[:t])}
    rows = []
    for t in TS:
        for name, fn in impls.items():
            g = captured(lambda fn=fn, t=t: [fn(t) for _ in range(REPS)], stream)
            dist.barrier()
            rows.append({"impl": name, "T": t,
                         "us": max_over_ranks(time_graph_us(g, stream, REPS))})
            del g
    return rows


def one_stream_correct(ar, buf, rank: int) -> list[dict]:
    """The one-stream all-reduce against NCCL's, eager and replayed from a graph."""
    out = []
    stream = torch.cuda.Stream()
    for t in (1, 3, 2048):
        for mode in ("eager", "graph"):
            torch.manual_seed(31 * rank + t)
            buf[:t].normal_()
            ref = buf[:t].float()
            dist.all_reduce(ref)
            if mode == "eager":
                ar.all_reduce(buf[:t], one_stream=True)
            else:
                snap = buf[:t].clone()
                g = captured(lambda t=t: ar.all_reduce(buf[:t], one_stream=True), stream)
                buf[:t].copy_(snap)  # captured() ran it once eagerly first
                torch.cuda.synchronize()
                g.replay()
            torch.cuda.synchronize()
            got = buf[:t].float()
            every = [torch.empty_like(got) for _ in range(ar.size)]
            dist.all_gather(every, got)
            out.append({"T": t, "mode": mode, "rel_err": float((got - ref).norm() / ref.norm()),
                        "ranks_equal": all(torch.equal(every[0], x) for x in every)})
    return out


def rank_main(rank: int, n: int, port: int, out_dir: str) -> None:
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n, device_id=torch.device("cuda", rank))
        from nanosched.kernels.ce_allreduce import make_all_reduce

        ar = make_all_reduce(rank, n, None, torch.device("cuda", rank))
        buf = ar.symmetric_zeros(max(TS), H, dtype=torch.bfloat16)
        nccl_buf = torch.randn(max(TS), H, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        rows = []
        for name, fn in variants(ar, buf).items():
            try:
                g = captured(lambda fn=fn: [fn() for _ in range(REPS)], stream)
                dist.barrier()
                rows.append({"variant": name, "us": max_over_ranks(
                    time_graph_us(g, stream, REPS))})
                del g
            except Exception as err:  # noqa: BLE001 - one variant's failure is a result
                torch.cuda.synchronize()
                rows.append({"variant": name, "error": f"{type(err).__name__}: {err}"})
            dist.barrier()
        res = {"rows": rows}
        for key, fn in (("correct", lambda: one_stream_correct(ar, buf, rank)),
                        ("sizes", lambda: sizes(ar, buf, nccl_buf, stream))):
            try:
                res[key] = fn()
            except Exception as err:  # noqa: BLE001 - keep the rows timed so far
                torch.cuda.synchronize()
                res[key] = [{"error": f"{type(err).__name__}: {err}"}]
            dist.barrier()
        every = [None] * n
        dist.all_gather_object(every, res["correct"])
        res["correct"] = [c for r in every for c in r]
        if rank == 0:
            Path(out_dir, "rows.json").write_text(json.dumps(res))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--out", default=None,
                   help="folder of the JSON (default $OUT, else bench/results), or a .json file")
    args = p.parse_args()
    if args.world < 2:
        sys.exit("ce_latency: needs 2 or more GPUs (--world)")
    res = run_ranks(rank_main, args.world, (), 300, "rows.json")
    name = torch.cuda.get_device_name(0).replace(" ", "_")
    stamp = time.strftime("%Y%m%dT%H%M%S")
    record = {"bench": "ce_latency", "device": name, "world": args.world,
              "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
              "date": stamp, "command": " ".join(sys.argv), "reps": REPS, **res}
    out = record_path(args.out, f"ce_latency-{name}-{args.world}gpu-{stamp}.json")
    out.write_text(json.dumps(record, indent=1))
    print(f"\n{name} x{args.world}, {REPS} calls a graph; us per call (slowest rank)")
    for r in res["rows"]:
        print(f"  {r['variant']:32} " + (f"{r['us']:8.1f}" if "us" in r else r["error"][:90]))
    ok = res["correct"]
    if any("error" in c for c in ok):
        print("one stream against NCCL:", next(c["error"] for c in ok if "error" in c))
    else:
        print(f"one stream against NCCL: max rel err {max(c['rel_err'] for c in ok):.2e}, "
              f"ranks equal {all(c['ranks_equal'] for c in ok)}")
    if any("error" in r for r in res["sizes"]):
        print("sizes:", res["sizes"][0]["error"])
        print(f"wrote {out}")
        return
    by = {(r["impl"], r["T"]): r["us"] for r in res["sizes"]}
    names = ["per-peer streams", "one stream", "nccl"]
    print(f"{'T':>6} " + " ".join(f"{x:>16}" for x in names))
    for t in TS:
        print(f"{t:6} " + " ".join(f"{by[x, t]:16.1f}" for x in names))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
