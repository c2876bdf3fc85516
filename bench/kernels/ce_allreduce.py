"""Does the copy-engine all-reduce keep its speed beside a GEMM, where NCCL's does not?

GPU, one process per GPU (N = all visible, or --world): nanosched.kernels.ce_allreduce against
NCCL on [T, 8192] bf16 (Llama-3-70B's hidden size).
1. Correct: eager and inside a CUDA graph (three all-reduces of different row ranges, replayed
   on fresh data), each against NCCL's sum (relative error) and every rank bitwise equal.
2. Alone: median time of one all-reduce, each inside a graph of REPS calls, per T and per bound
   of the reduction's CTAs; NCCL likewise.
3. Beside the Llama-3-70B tp=N `ug` GEMM [2048, 8192] x [8192, 2*28672/N], sustained: the GEMM
   looped on its stream, the collective's graph on another, each queue kept short and topped
   up by polling; the same fixed number of collectives on every rank (flags pair them); rates in
   the window where both run after SETTLE_S; SM clock and board power sampled. Variants: NCCL
   (whole GPU, and bounded to 16 CTAs beside a GEMM told to leave 16 SMs); the copy engine with
   its reduction bounded to k CTAs beside a GEMM told to leave k SMs (cuBLASLt SM target), and
   inside a green-context partition of k SMs with the GEMM on the rest. P_net: against the
   faster of its graph-timed and sustained alone figures; P_gemm: against cuBLAS on all SMs.
4. With --attention, also beside the decode attention (`ce_beside_attn.py`): does the copy
   engines' traffic take the HBM bandwidth the attention needs?
With --one-stream every copy-engine call runs all its steps on the caller's stream (the
all-reduce's `one_stream`: no side streams), so the same figures compare that form.
Writes ce_allreduce-<GPU>-<N>gpu[-1stream]-<stamp>.json to --out, else $OUT, else
bench/results/; prints tables last.
Run: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  PYTHONPATH=. python bench/kernels/ce_allreduce.py [--world 2] [--quick] [--no-beside] \
  [--subchunks auto,1,2,4,8] [--one-stream] [--attention]
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
    SETTLE_S,
    WINDOW_S,
    H,
    alone,
    collective_alone,
    correct,
    net_alone_us,
    record_path,
    run_ranks,
    steps,
)
from bench.kernels.ce_beside_attn import beside_attention, print_rows  # noqa: E402
from bench.kernels.ce_beside_attn import summary as attention_summary  # noqa: E402
from nanosched.profiler.timing import sustained_fixed, sustained_run  # noqa: E402

INTER = 28672
MAX_T = 4096


def _window(tele, host_window):
    reading = tele.reading(*host_window) if tele else None
    return reading.to_json() if reading else None


def _beside(tp, buf, ts, ks, tele):
    """Per T: NCCL (whole GPU; bounded to 16 CTAs beside a GEMM told to leave those SMs), and the
    copy engine with its reduction bounded to k CTAs beside a GEMM told to leave k SMs (cuBLASLt
    SM target), or inside a green-context partition of k SMs with the GEMM on the rest."""
    from nanosched.greenctx import split_sms
    from nanosched.kernels.impls import cublaslt_sm_target

    n, total = tp.size, torch.cuda.get_device_properties(0).multi_processor_count
    a = torch.randn(2048, H, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(H, 2 * INTER // n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(2048, 2 * INTER // n, device="cuda", dtype=torch.bfloat16)
    low, high = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)

    def gemm(sms=None):
        if sms is None:
            return lambda: torch.mm(a, b, out=c)

        def told():
            with cublaslt_sm_target(sms, total):
                torch.mm(a, b, out=c)
        return told

    device = torch.device("cuda", torch.cuda.current_device())

    def looped(fn, stream):  # a GEMM looped until the clock settled: (us, telemetry)
        run = sustained_run([(fn, stream, 100.0)], device, SETTLE_S, WINDOW_S)
        return run.median_us[0], _window(tele, run.host_window)

    g_alone, g_read = looped(gemm(), low)
    rows = [{"variant": "gemm alone", "gemm_us": g_alone, "telemetry": g_read}]
    for t in ts:
        variants = [("nccl", "nccl", None, None), ("nccl_ctas16 | gemm -16 SMs", "nccl_ctas16",
                                                    total - 16, None)]
        for k in ks:
            variants.append((f"copy_engine_ctas{k} | gemm -{k} SMs", f"copy_engine_ctas{k}",
                             total - k, None))
            variants.append((f"copy_engine in {k} green SMs | gemm rest", "copy_engine", None, k))
        for name, impl, told, green in variants:
            try:
                pair = split_sms(torch.cuda.current_device(), green) if green else None
                net_stream = pair.small.stream if pair else high
                gemm_stream = pair.rest.stream if pair else low
                g, graph_alone, n_net, net_alone = collective_alone(
                    lambda t=t, impl=impl: tp.all_reduce(buf[:t], impl), net_stream)
                fn = gemm(told)
                gemm_own, _ = looped(fn, gemm_stream)
                dist.barrier()
                both = sustained_fixed(fn, gemm_stream, g.replay, net_stream, n_net, SETTLE_S)
                gemm_us, net_us = both.loop_us, both.fixed_us
                read = _window(tele, both.host_window)
                rows.append({"variant": name, "T": t, "impl": impl, "gemm_sms": told,
                             "net_graph_alone_us": graph_alone, "net_alone_us": net_alone,
                             "net_beside_us": net_us, "gemm_beside_us": gemm_us,
                             "gemm_alone_us": g_alone, "gemm_alone_same_sms_us": gemm_own,
                             "sms": [pair.small.sms, pair.rest.sms] if pair else None,
                             "telemetry": read})
                del g
                if pair:
                    torch.cuda.synchronize()
                    pair.close()
            except Exception as err:  # noqa: BLE001 - one variant's failure is a result
                rows.append({"variant": name, "T": t, "error": f"{type(err).__name__}: {err}"})
                torch.cuda.synchronize()
            dist.barrier()
    return rows


def rank_main(rank: int, n: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n, device_id=torch.device("cuda", rank))
        from nanosched.kernels.ce_allreduce import make_all_reduce
        from nanosched.models.parallel import TensorParallel
        from nanosched.profiler.telemetry import open_telemetry

        ar = make_all_reduce(rank, n, None, torch.device("cuda", rank))
        ar.one_stream = args.one_stream
        tp = TensorParallel(rank, n, copy_engine=ar)
        buf = ar.symmetric_zeros(MAX_T, H, dtype=torch.bfloat16)
        nccl_buf = torch.randn(MAX_T, H, device="cuda", dtype=torch.bfloat16)
        tele = open_telemetry(rank)
        res = {"correct": [c for p in args.subchunks for c in correct(ar, buf, rank, n, p)]}
        if rank == 0:
            print("correctness done", flush=True)
        ts = [512, 2048] if args.quick else [128, 512, 1024, 2048]
        res["alone"] = alone(ar, buf, nccl_buf, ts, args.subchunks, [None, 8, 16, 32])
        res["steps"] = steps(ar, buf, ts)
        if rank == 0:
            print("alone done", flush=True)
        res["beside"] = [] if args.no_beside else _beside(tp, buf, [512, 2048],
                                                          [16] if args.quick else [8, 16], tele)
        res["attention"] = beside_attention(tp, ar, buf, [512, 2048], lambda hw: _window(
            tele, hw)) if args.attention else []
        every = [None] * n
        dist.all_gather_object(every, res)
        if rank == 0:
            Path(out_dir, "ranks.json").write_text(json.dumps(every, default=str))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _summary(every: list[dict]) -> dict:
    r0 = every[0]
    ok = {"max_rel_err": max(c["rel_err"] for r in every for c in r["correct"]),
          "ranks_equal": all(c["ranks_equal"] for r in every for c in r["correct"])}
    beside = []
    for i, row in enumerate(r0["beside"]):
        if "error" in row or row["variant"] == "gemm alone":
            beside.append(row)
            continue
        rs = [r["beside"][i] for r in every]
        # P_gemm against cuBLAS on the whole GPU
        p_net = min(net_alone_us(x) / x["net_beside_us"] for x in rs)
        p_gemm = min(x["gemm_alone_us"] / x["gemm_beside_us"] for x in rs)
        p_gemm_own = min(x["gemm_alone_same_sms_us"] / x["gemm_beside_us"] for x in rs)
        beside.append({**row, "P_net": p_net, "P_gemm": p_gemm, "P_sum": p_net + p_gemm,
                       "P_gemm_vs_same_sms": p_gemm_own,
                       "telemetry_per_rank": [x["telemetry"] for x in rs]})
    attention = attention_summary([r["attention"] for r in every]) if r0["attention"] else []
    return {"correct": ok, "alone": r0["alone"], "steps": r0["steps"], "beside": beside,
            "attention": attention}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-beside", action="store_true")
    p.add_argument("--attention", action="store_true",
                   help="also beside the decode attention (bench/kernels/ce_beside_attn.py)")
    p.add_argument("--out", default=None,
                   help="folder of the JSON (default $OUT, else bench/results), or a .json file")
    p.add_argument("--one-stream", action="store_true",
                   help="every copy-engine call on the caller's stream alone (one_stream)")
    p.add_argument("--subchunks", default="auto,1,2,4",
                   help="sub-chunk counts to check and time alone (auto: by size)")
    args = p.parse_args()
    args.subchunks = [None if x.strip() == "auto" else int(x)
                      for x in args.subchunks.split(",")]
    every = run_ranks(rank_main, args.world, (args,), 540, "ranks.json")
    name = torch.cuda.get_device_name(0).replace(" ", "_")
    stamp = time.strftime("%Y%m%dT%H%M%S")
    record = {"bench": "ce_allreduce", "device": name, "world": args.world,
              "one_stream": args.one_stream,
              "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
              "date": stamp, "command": " ".join(sys.argv), **_summary(every), "ranks": every}
    fname = f"ce_allreduce-{name}-{args.world}gpu{'-1stream' * args.one_stream}-{stamp}.json"
    out = record_path(args.out, fname)
    out.write_text(json.dumps(record, indent=1, default=str))
    s = record
    print(f"\n{name} x{args.world}; correct (sub-chunks {args.subchunks}): max rel err "
          f"{s['correct']['max_rel_err']:.2e}, ranks equal {s['correct']['ranks_equal']}")
    print(f"{'impl':12} {'T':>5} {'subchunks':>9} {'max_ctas':>8} {'us':>8}")
    for r in s["alone"]:
        parts = "-" if r["impl"] == "nccl" else r["subchunks"] or "auto"
        print(f"{r['impl']:12} {r['T']:5} {parts:>9} {r['max_ctas'] or '-':>8} {r['us']:8.1f}")
    print(f"{'step':28} {'T':>5} {'us':>8} {'GB/s per peer':>13}")
    for r in s["steps"]:
        rate = f"{r['bytes_per_peer'] / r['us'] / 1e3:13.0f}" if "bytes_per_peer" in r else ""
        print(f"{r['step']:28} {r['T']:5} {r['us']:8.1f} {rate}")
    print(f"{'variant':38} {'T':>5} {'net':>7} {'beside':>7} {'gemm':>6} {'P_net':>6} "
          f"{'P_gemm':>6} {'P_sum':>6} clock/power")
    for r in s["beside"]:
        if "error" in r:
            print(f"{r['variant']:38} {r.get('T', ''):>5} ERROR {r['error'][:80]}")
        elif "P_net" in r:
            tel = r["telemetry"] or {}
            alone = net_alone_us(r)
            print(f"{r['variant']:38} {r['T']:5} {alone:7.1f} {r['net_beside_us']:7.1f} "
                  f"{r['gemm_beside_us']:6.0f} {r['P_net']:6.2f} {r['P_gemm']:6.2f} "
                  f"{r['P_sum']:6.2f} {tel.get('clock_mhz')}/{tel.get('power_w')}")
        else:
            print(f"gemm alone {r['gemm_us']:.1f} us {r['telemetry']}")
    if s["attention"]:
        print_rows(s["attention"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
