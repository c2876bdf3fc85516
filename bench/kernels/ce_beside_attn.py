"""(used by ce_allreduce.py --attention) The all-reduces beside the decode attention: does the
copy engines' traffic take the HBM bandwidth the attention lives on?

Per rank: a paged decode batch in Llama-3-70B tp = N's shapes per rank (64/N query heads and
8/N KV heads of 128, bf16 cache, REQUESTS requests of CONTEXT tokens: the 1024 / 512 steady
state's decode rows at about their mean context), its attention as the engine runs it on all
SMs (`dispatch.decode_attention` with the default options) looped on one stream, and each
all-reduce's CUDA graph on a high-priority stream, sustained as the GEMM pairs are
(`timing.sustained_fixed`, the same number of collectives on every rank). Rows: the attention
alone; per T and implementation (NCCL; the copy engine, reduction unbounded; the copy engine on
one stream) the collective alone and both sides beside each other, with clock and power.
P_attn and P_net are each side's speed beside the other over its own alone.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from bench.kernels.ce_allreduce_steps import (
    SETTLE_S,
    WINDOW_S,
    collective_alone,
    net_alone_us,
)
from nanosched.profiler.timing import sustained_fixed, sustained_run

HQ, HKV, HD, PAGE = 64, 8, 128, 16  # Llama-3-70B, before the tp split
REQUESTS, CONTEXT = 384, 1280
IMPLS = (("nccl", "nccl", False), ("copy_engine", "copy_engine", False),
         ("copy_engine, one stream", "copy_engine", True))


def _attention(tp_size: int) -> Any:
    """One launch of the engine's decode attention over the batch (module docstring)."""
    from nanosched.kernels.dispatch import KernelOptions, decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv = HQ // tp_size, max(1, HKV // tp_size)
    pages_per = math.ceil(CONTEXT / PAGE)
    pages = REQUESTS * pages_per
    k = torch.randn(pages, PAGE, hkv, HD, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    tables = torch.randperm(pages, device="cuda", generator=g).int().view(REQUESTS, pages_per)
    lens = torch.full((REQUESTS,), CONTEXT, dtype=torch.int32, device="cuda")
    q = torch.randn(REQUESTS, hq, HD, device="cuda", dtype=torch.bfloat16, generator=g)
    out, opts = torch.empty_like(q), KernelOptions()

    def run() -> None:
        decode_attention(q, k, v, tables, lens, CONTEXT, HD ** -0.5, out, opts)
    return run


def beside_attention(tp: Any, ar: Any, buf: torch.Tensor, ts: list[int], window: Any) -> list[dict]:
    """The rows of the module docstring; `window(host_window)` reads telemetry (or None)."""
    device = torch.device("cuda", torch.cuda.current_device())
    low, high = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    attn = _attention(tp.size)
    run = sustained_run([(attn, low, 100.0)], device, SETTLE_S, WINDOW_S)
    a_alone = run.median_us[0]
    rows = [{"variant": "attention alone", "attn_us": a_alone,
             "requests": REQUESTS, "context": CONTEXT, "telemetry": window(run.host_window)}]
    for t in ts:
        for name, impl, one in IMPLS:
            saved, ar.one_stream = ar.one_stream, one
            try:
                g, graph_alone, n_net, net_alone = collective_alone(
                    lambda t=t, impl=impl: tp.all_reduce(buf[:t], impl), high)
                dist.barrier()
                both = sustained_fixed(attn, low, g.replay, high, n_net, SETTLE_S)
                rows.append({"variant": name, "T": t, "impl": impl, "one_stream": one,
                             "net_graph_alone_us": graph_alone, "net_alone_us": net_alone,
                             "net_beside_us": both.fixed_us, "attn_beside_us": both.loop_us,
                             "attn_alone_us": a_alone, "telemetry": window(both.host_window)})
                del g
            except Exception as err:  # noqa: BLE001 - one variant's failure is a result
                torch.cuda.synchronize()
                rows.append({"variant": name, "T": t, "error": f"{type(err).__name__}: {err}"})
            finally:
                ar.one_stream = saved
            dist.barrier()
    return rows


def summary(every: list[list[dict]]) -> list[dict]:
    """Rank 0's rows with P_attn and P_net, each the worst rank's (a pair is as slow as its
    slowest side)."""
    out = []
    for i, row in enumerate(every[0]):
        if "error" in row or "T" not in row:
            out.append(row)
            continue
        rs = [r[i] for r in every]
        if any(x["net_beside_us"] is None or x["attn_beside_us"] is None for x in rs):
            out.append({**row, "error": "too few launches inside the window"})
            continue
        p_net = min(net_alone_us(x) / x["net_beside_us"] for x in rs)
        p_attn = min(x["attn_alone_us"] / x["attn_beside_us"] for x in rs)
        out.append({**row, "P_net": p_net, "P_attn": p_attn, "P_sum": p_net + p_attn})
    return out


def print_rows(rows: list[dict]) -> None:
    """The table `ce_allreduce.py --attention` prints."""
    print(f"{'beside the decode attention':28} {'T':>5} {'net':>7} {'beside':>7} {'attn':>6} "
          f"{'P_net':>6} {'P_attn':>6} {'P_sum':>6} clock/power")
    for r in rows:
        tel = r.get("telemetry") or {}
        if "error" in r:
            print(f"{r['variant']:28} {r.get('T', ''):>5} ERROR {r['error'][:80]}")
        elif "P_net" in r:
            alone = net_alone_us(r)
            print(f"{r['variant']:28} {r['T']:5} {alone:7.1f} {r['net_beside_us']:7.1f} "
                  f"{r['attn_beside_us']:6.0f} {r['P_net']:6.2f} {r['P_attn']:6.2f} "
                  f"{r['P_sum']:6.2f} {tel.get('clock_mhz')}/{tel.get('power_w')}")
        else:
            print(f"attention alone {r['attn_us']:.1f} us ({r['requests']} requests x "
                  f"{r['context']} tokens) {tel}")
