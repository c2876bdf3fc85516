"""How the L2 flush before each timed launch changes a kernel row (`profiler.timing.bench_us`).

    PYTHONPATH=. python bench/hardware/row_flush.py [--tokens 1024]

Llama-3-8B's GEMMs (`kqv`, `o`, `ug`, `d`: bf16 `torch.nn.functional.linear`, random data) and
two elementwise kernels (RMSNorm + residual, SiLU-and-mul: the Triton ones the model runs) at
`--tokens` rows (weights and inputs of `--w-std` and `--x-std`: a GEMM's power, and so its
clock, depends on its data), each timed three ways: the L2 flushed by writing 128 MB before
every launch (the kernel then also pays for writing back the dirty lines it evicts: the rows'
way until 2026-11-25), flushed by reading 128 MB (a clean, cold L2: `bench_us`'s way since),
and not flushed (its inputs stay in L2 from the launch before, as a layer leaves the previous
op's output there). GPU only; JSON to $OUT or bench/results/; table last.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench._common import environment, print_table, write_result
from nanosched.profiler import timing

HIDDEN, INTER, QKV = 4096, 14336, 6144


def timed(fn, device: torch.device, mode: str) -> float:
    """`fn`'s time with the L2 flushed by a write ('write'), a read ('read': `bench_us`'s own
    flush) or not ('none'); a flush's own time is not counted."""
    if mode != "write":
        return timing.bench_us(fn, device, flush=mode == "read")
    buf = timing._flush_buffer(device)

    def write_then_fn() -> None:
        buf.zero_()
        fn()
    return timing.bench_us(write_then_fn, device, flush=False) - \
        timing.bench_us(buf.zero_, device, flush=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--w-std", type=float, default=0.02, help="weights' standard deviation")
    ap.add_argument("--x-std", type=float, default=1.0, help="inputs' standard deviation")
    args = ap.parse_args()
    from nanosched.kernels.elementwise import rms_norm_add, silu_mul

    dev = torch.device("cuda", 0)
    t = args.tokens
    x = torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16) * args.x_std
    a = torch.randn(t, INTER, device=dev, dtype=torch.bfloat16) * args.x_std
    gu = torch.randn(t, 2 * INTER, device=dev, dtype=torch.bfloat16)
    ws = {n: torch.randn(o, i, device=dev, dtype=torch.bfloat16) * args.w_std
          for n, (o, i) in {"kqv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN),
                            "ug": (2 * INTER, HIDDEN), "d": (HIDDEN, INTER)}.items()}
    outs = {n: torch.empty(t, w.shape[0], device=dev, dtype=torch.bfloat16)
            for n, w in ws.items()}
    res, norm_w = torch.randn_like(x), torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)
    y, r_out, act = torch.empty_like(x), torch.empty_like(x), torch.empty_like(a)
    ops = {n: (lambda n=n: F.linear(a if n == "d" else x, ws[n], out=outs[n])) for n in ws}
    ops["rms_norm_add"] = lambda: rms_norm_add(x, res, norm_w, 1e-5, y, r_out)
    ops["silu_mul"] = lambda: silu_mul(gu, act)
    rows = []
    for name, fn in ops.items():
        row = {"op": name, "tokens": t}
        for mode in ("write", "read", "none"):
            row[mode] = timed(fn, dev, mode)
        rows.append(row)
    path = write_result("row_flush", {"env": environment(), "tokens": t, "w_std": args.w_std,
                                      "x_std": args.x_std, "rows": rows})
    print(path)
    print_table(rows, [("op", "op", ""), ("write", "write-flush us", ".1f"),
                       ("read", "read-flush us", ".1f"), ("none", "no flush us", ".1f")])


if __name__ == "__main__":
    main()
