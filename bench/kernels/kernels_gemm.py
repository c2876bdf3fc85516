"""Persistent Triton GEMM vs torch (cuBLAS) at Llama-3-8B GEMM shapes, 128..2048 tokens.

    PYTHONPATH=. python bench/kernels/kernels_gemm.py [--tokens 128,256,512,1024,2048] [--num-sms N]
                                 [--partition-sms 100,68]

Shapes (out = x[T, K] @ w[N, K].T, bf16): kqv N=6144 K=4096, o N=4096 K=4096, ug N=28672
K=4096, d N=4096 K=14336. The Triton GEMM runs with NUM_SMS = all SMs (or --num-sms) for a few
tile configurations; the best is reported beside cuBLAS, in TFLOP/s and as a ratio. Random data,
warm-up, medians (triton.testing.do_bench); GEMMs are compute-bound, so inputs are not rotated.

With `--partition-sms`, the same GEMMs are timed again on a disjoint green-context partition of
each size (nanosched.greenctx.split_sms; the Triton GEMM then runs NUM_SMS = the
partition's SMs), and each row also gives its speed relative to cuBLAS on the whole GPU
(`vs_full_cublas`; ideal = partition SMs / all SMs).
JSON to $OUT or bench/results/; a table last.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch

from bench._common import environment, median_ms, print_table, write_result

SHAPES = {"kqv": (6144, 4096), "o": (4096, 4096), "ug": (28672, 4096), "d": (4096, 14336)}
TILES = [  # (block_m, block_n, block_k, group_m, num_warps, num_stages)
    (128, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 3),
    (64, 128, 64, 8, 4, 4),
    (128, 128, 128, 8, 8, 2),
]


def bench_shape(tokens: int, n: int, k: int, num_sms: int,
                stream: torch.cuda.Stream | None = None) -> dict:
    """Time cuBLAS and every Triton tile config for one shape on `stream` (None = current)."""
    from nanosched.kernels.gemm import GemmConfig, persistent_linear

    gen = torch.Generator(device="cuda").manual_seed(tokens * 7 + n)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
    out = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * tokens * n * k
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        cublas_ms = median_ms(lambda: torch.mm(x, w.t(), out=out))
        want = out.float().clone()
        triton_ms = {}
        for bm, bn, bk, gm, warps, stages in TILES:
            cfg = GemmConfig(num_sms=num_sms, block_m=bm, block_n=bn, block_k=bk, group_m=gm,
                             num_warps=warps, num_stages=stages)
            try:
                triton_ms[f"{bm}x{bn}x{bk}/g{gm}/w{warps}/s{stages}"] = median_ms(
                    lambda cfg=cfg: persistent_linear(x, w, None, out, cfg))
            except Exception as exc:  # e.g. out of shared memory for this tile
                triton_ms[f"{bm}x{bn}x{bk}/g{gm}/w{warps}/s{stages}"] = f"failed: {exc}"[:200]
    err = ((out.float() - want).norm() / want.norm()).item()
    timed = {c: ms for c, ms in triton_ms.items() if isinstance(ms, float)}
    best = min(timed, key=timed.get)
    return {"tokens": tokens, "n": n, "k": k, "num_sms": num_sms, "cublas_ms": cublas_ms,
            "cublas_tflops": flops / cublas_ms / 1e9, "triton_ms_by_config": triton_ms,
            "best_config": best, "triton_ms": timed[best],
            "triton_tflops": flops / timed[best] / 1e9, "ratio": cublas_ms / timed[best],
            "last_config_rel_err": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,256,512,1024,2048")
    ap.add_argument("--num-sms", type=int, default=None, help="Triton programs (default: all)")
    ap.add_argument("--partition-sms", default="",
                    help="comma-separated SM counts of green-context partitions to time too")
    args = ap.parse_args()
    env = environment()
    num_sms = args.num_sms or env["num_sms"]
    tokens_list = [int(t) for t in args.tokens.split(",")]
    rows = []
    for tokens in tokens_list:
        for op, (n, k) in SHAPES.items():
            rows.append({"op": op, "partition_sms": env["num_sms"],
                         **bench_shape(tokens, n, k, num_sms)})
    full = {(r["op"], r["tokens"]): r["cublas_ms"] for r in rows}
    for sms in [int(s) for s in args.partition_sms.split(",") if s]:
        from nanosched.greenctx import split_sms

        pair = split_sms(0, sms)
        try:
            for tokens in tokens_list:
                for op, (n, k) in SHAPES.items():
                    r = bench_shape(tokens, n, k, pair.small.sms, stream=pair.small.stream)
                    rows.append({"op": op, "partition_sms": pair.small.sms, **r})
        finally:
            torch.cuda.synchronize()
            pair.close()
    for r in rows:
        ref = full[(r["op"], r["tokens"])]
        r["cublas_vs_full"] = ref / r["cublas_ms"]
        r["triton_vs_full"] = ref / r["triton_ms"]
    path = write_result("kernels_gemm", {"env": env, "dtype": "bfloat16", "tiles": TILES,
                                         "rows": rows})
    print(f"{env['device']} ({env['num_sms']} SMs), Triton NUM_SMS = {num_sms}; results in "
          f"{path}")
    print_table(rows, [("op", "op", ""), ("tokens", "T", ""), ("partition_sms", "SMs", ""),
                       ("cublas_vs_full", "cuBLAS/full", ".2f"),
                       ("triton_vs_full", "Triton/full", ".2f"),
                       ("cublas_tflops", "cuBLAS TF/s",
                                                                ".0f"),
                       ("triton_tflops", "Triton TF/s", ".0f"), ("ratio", "Triton/cuBLAS",
                                                                 ".2f"),
                       ("best_config", "best tile", "")])


if __name__ == "__main__":
    main()
