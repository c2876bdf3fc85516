"""Triton grouped GEMM vs the torch loop over experts at Mixtral-8x7B tp=1 shapes, 128..2048 tokens.

    PYTHONPATH=. python bench/kernels/kernels_moe.py [--tokens 128,256,512,1024,2048] [--num-sms N]
                                [--routing random|uniform]

Shapes (E = 8 experts, top-2, bf16; rows = 2 T): gate_up out[2T, 28672] = x[T, 4096] rows
(each token read twice through x_rows) @ w[e].T with w [8, 28672, 4096]; down out[2T, 4096] =
act[2T, 14336] @ w[e].T with w [8, 4096, 14336]. Routing: top-2 of random router logits
(uneven counts, the default) or uniform (row i → expert i mod 8). Every call includes the
device-side sort and tile schedule. The Triton kernel runs for a few tile configurations, each
with the plain upper-bound grid and persistent on NUM_SMS programs (all SMs, or --num-sms); the
best is reported beside the torch loop (`reference.grouped_linear`, one cuBLAS GEMM per expert
plus a host sync) and beside one dense cuBLAS GEMM of the same FLOPs (all rows on expert 0's
weights: the ceiling a grouped GEMM aims at). TFLOP/s = 2 · rows · N · K / time. Random data,
warm-up, medians (triton.testing.do_bench). JSON to $OUT or bench/results/; a table last.
"""

from __future__ import annotations

import argparse

import torch

from bench._common import environment, median_ms, print_table, write_result

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 4096, 14336
SHAPES = {"gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}  # (N, K)
TILES = [  # (block_m, block_n, block_k, group_m, num_warps, num_stages)
    (64, 128, 64, 8, 4, 4),
    (128, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 3),
    (64, 256, 64, 8, 8, 3),
]


def routing(tokens: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Expert ids [tokens * TOP_K], token-major."""
    if kind == "uniform":
        return torch.arange(tokens * TOP_K, device="cuda") % NUM_EXPERTS
    logits = torch.randn(tokens, NUM_EXPERTS, device="cuda", generator=gen)
    return logits.topk(TOP_K, dim=-1).indices.flatten()


def bench_shape(op: str, tokens: int, weights: torch.Tensor, kind: str, num_sms: int) -> dict:
    """Time the torch loop, dense cuBLAS and every Triton config for one op and token count."""
    from nanosched.kernels import reference as ref
    from nanosched.kernels.grouped_gemm import GroupedGemmConfig, grouped_linear

    n, k = SHAPES[op]
    rows = TOP_K * tokens
    gen = torch.Generator(device="cuda").manual_seed(tokens * 7 + n)
    ids = routing(tokens, kind, gen)
    if op == "gate_up":
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        x_rows = torch.arange(tokens, device="cuda").repeat_interleave(TOP_K)
    else:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        x_rows = None
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * rows * n * k
    loop_ms = median_ms(lambda: ref.grouped_linear(x, weights, ids, x_rows, out))
    want = out.float().clone()
    dense_x = x if x_rows is None else x.index_select(0, x_rows)
    dense_ms = median_ms(lambda: torch.mm(dense_x, weights[0].t(), out=out))
    triton_ms, errors = {}, {}
    for bm, bn, bk, gm, warps, stages in TILES:
        for programs in (None, num_sms):
            name = f"{bm}x{bn}x{bk}/g{gm}/w{warps}/s{stages}/" + (
                "grid" if programs is None else f"p{programs}")
            cfg = GroupedGemmConfig(num_programs=programs, block_m=bm, block_n=bn, block_k=bk,
                                    group_m=gm, num_warps=warps, num_stages=stages)
            try:
                grouped_linear(x, weights, ids, x_rows, out, cfg)
                errors[name] = ((out.float() - want).norm() / want.norm()).item()
                triton_ms[name] = median_ms(
                    lambda cfg=cfg: grouped_linear(x, weights, ids, x_rows, out, cfg))
            except Exception as exc:  # e.g. out of shared memory for this tile
                triton_ms[name] = f"failed: {exc}"[:200]
    timed = {c: ms for c, ms in triton_ms.items() if isinstance(ms, float)}
    best = min(timed, key=timed.get)
    counts = torch.bincount(ids, minlength=NUM_EXPERTS).tolist()
    return {"op": op, "tokens": tokens, "rows": rows, "n": n, "k": k, "expert_rows": counts,
            "loop_ms": loop_ms, "loop_tflops": flops / loop_ms / 1e9,
            "dense_ms": dense_ms, "dense_tflops": flops / dense_ms / 1e9,
            "triton_ms_by_config": triton_ms, "rel_err_by_config": errors,
            "best_config": best, "triton_ms": timed[best],
            "triton_tflops": flops / timed[best] / 1e9, "speedup": loop_ms / timed[best],
            "max_rel_err": max(errors.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,256,512,1024,2048")
    ap.add_argument("--num-sms", type=int, default=None,
                    help="programs of the persistent variant (default: all SMs)")
    ap.add_argument("--routing", choices=("random", "uniform"), default="random")
    args = ap.parse_args()
    env = environment()
    num_sms = args.num_sms or env["num_sms"]
    rows = []
    for op, (n, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(n)
        weights = (torch.randn(NUM_EXPERTS, n, k, device="cuda", generator=gen)
                   .mul_(k ** -0.5).to(torch.bfloat16))  # [E, N, K]
        for tokens in map(int, args.tokens.split(",")):
            rows.append(bench_shape(op, tokens, weights, args.routing, num_sms))
        del weights
    path = write_result("kernels_moe", {"env": env, "dtype": "bfloat16", "model": "mixtral-8x7b",
                                        "tp": 1, "routing": args.routing, "tiles": TILES,
                                        "num_sms": num_sms, "rows": rows})
    print(f"{env['device']} ({env['num_sms']} SMs), persistent programs = {num_sms}, "
          f"{args.routing} routing; results in {path}")
    print_table(rows, [("op", "op", ""), ("tokens", "T", ""),
                       ("loop_tflops", "loop TF/s", ".0f"),
                       ("triton_tflops", "Triton TF/s", ".0f"),
                       ("dense_tflops", "dense cuBLAS TF/s", ".0f"),
                       ("speedup", "Triton/loop", ".2f"), ("max_rel_err", "max rel err", ".1e"),
                       ("best_config", "best config", "")])


if __name__ == "__main__":
    main()
