"""Triton grouped GEMM vs the torch loop over experts at Mixtral-8x7B tp=1 shapes, 128..2048 tokens.

    PYTHONPATH=. python bench/kernels/kernels_moe.py [--tokens 128,256,512,1024,2048] [--num-sms N]
                                [--routing random|uniform] [--fp8] [--narrow]

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
`--fp8` adds the W8A8 grouped GEMM (e4m3 x and experts, row scales; FP8_TILES, each grid and
persistent), its error against the exact emulation (`reference.grouped_linear_fp8`), the dense
`torch._scaled_mm` of the same FLOPs, and its speedup over the best bf16 Triton configuration;
`gate_up` then includes the quantisation of its T input rows, as models/moe.py runs it.
`--narrow` adds the narrow W8A8 grouped GEMM (kernels/grouped_narrow.py) over NARROW_LAUNCHES
beside the FP8 grouped GEMM's default launch (FP8_CONFIG), both the GEMM alone and timed as the
median of CUDA-graph replays (bench/_common.graph_us): time, TFLOP/s of the real rows, the experts'
weight bytes a second (each expert with rows read once), the best launch and its error.
"""

from __future__ import annotations

import argparse

import torch

from bench._common import environment, fastest, graph_us, median_ms, print_table, write_result

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 4096, 14336
SHAPES = {"gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}  # (N, K)
TILES = [  # (block_m, block_n, block_k, group_m, num_warps, num_stages)
    (64, 128, 64, 8, 4, 4),
    (128, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 3),
    (64, 256, 64, 8, 8, 3),
]
FP8_TILES = [  # e4m3: a byte an element, K-steps of 128
    (128, 128, 128, 8, 8, 3),
    (128, 256, 128, 8, 8, 3),
    (128, 256, 128, 8, 8, 4),
    (64, 256, 128, 8, 4, 4),
    (128, 128, 128, 8, 4, 4),
]

# the narrow grouped GEMM's launches timed with --narrow (BLOCK_N, BLOCK_K, piece rows, warps,
# stages, split K), every one with 256-row chunks
NARROW_LAUNCHES = [
    (128, 128, 32, 8, 3, 1),
    (128, 128, 64, 8, 3, 1),
    (128, 128, 32, 8, 4, 1),
    (64, 128, 32, 4, 4, 1),
    (64, 128, 32, 8, 4, 1),
    (256, 128, 32, 8, 3, 1),
    (128, 128, 32, 8, 3, 2),
    (64, 128, 32, 4, 4, 2),
]


def routing(tokens: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Expert ids [tokens * TOP_K], token-major."""
    if kind == "uniform":
        return torch.arange(tokens * TOP_K, device="cuda") % NUM_EXPERTS
    logits = torch.randn(tokens, NUM_EXPERTS, device="cuda", generator=gen)
    return logits.topk(TOP_K, dim=-1).indices.flatten()


def _configs(tiles: list[tuple[int, ...]], num_sms: int):
    """(name, GroupedGemmConfig) of each tile, on its upper-bound grid and persistent."""
    from nanosched.kernels.grouped_gemm import GroupedGemmConfig

    for bm, bn, bk, gm, warps, stages in tiles:
        for programs in (None, num_sms):
            yield (f"{bm}x{bn}x{bk}/g{gm}/w{warps}/s{stages}/"
                   + ("grid" if programs is None else f"p{programs}"),
                   GroupedGemmConfig(num_programs=programs, block_m=bm, block_n=bn, block_k=bk,
                                     group_m=gm, num_warps=warps, num_stages=stages))


def fp8_shape(op: str, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              x_rows: torch.Tensor | None, num_sms: int, bf16_ms: float) -> dict:
    """The W8A8 grouped GEMM of one shape: every FP8_TILES config, its error, dense FP8."""
    from nanosched.kernels import dispatch as K
    from nanosched.kernels import reference as ref
    from nanosched.kernels.grouped_gemm import grouped_linear

    rows, (n, k) = ids.shape[0], SHAPES[op]
    w8, wsc = ref.quantize_fp8(weights)  # [E, N, K] e4m3, [E, N]
    x8, xs = ref.quantize_fp8(x)
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    want = torch.empty_like(out)
    ref.grouped_linear_fp8(x8, xs, w8, wsc, ids, x_rows, want)
    flops = 2 * rows * n * k
    opts = K.KernelOptions()
    times, errors = {}, {}
    for name, cfg in _configs(FP8_TILES, num_sms):
        def run(cfg=cfg) -> None:
            if x_rows is not None:  # gate_up: its normed rows quantised first
                K.quantize_rows(x, x8, xs, opts)
            grouped_linear(x8, w8, ids, x_rows, out, cfg, x_scale=xs, w_scale=wsc)
        try:
            run()
            errors[name] = ((out.float() - want.float()).norm() / want.float().norm()).item()
            times[name] = median_ms(run)
        except Exception as exc:  # e.g. out of shared memory for this tile
            times[name] = f"failed: {exc}"[:200]
    timed = {c: ms for c, ms in times.items() if isinstance(ms, float)}
    best = min(timed, key=timed.get)
    dense8 = x8 if x_rows is None else x8.index_select(0, x_rows)
    one = torch.ones(rows, 1, device="cuda")
    dense_ms = median_ms(lambda: torch._scaled_mm(
        dense8, w8[0].t(), scale_a=one, scale_b=wsc[0].view(1, -1), out_dtype=torch.bfloat16,
        use_fast_accum=True))
    return {"fp8_ms_by_config": times, "fp8_rel_err_by_config": errors, "fp8_best_config": best,
            "fp8_ms": timed[best], "fp8_tflops": flops / timed[best] / 1e9,
            "fp8_dense_tflops": flops / dense_ms / 1e9, "fp8_speedup": bf16_ms / timed[best],
            "fp8_rel_err": errors[best]}



def narrow_shape(op: str, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 x_rows: torch.Tensor | None) -> dict:
    """The narrow W8A8 grouped GEMM of one shape over NARROW_LAUNCHES (a launch that does not
    fit an SM is skipped) beside the FP8 grouped GEMM's default launch, in CUDA graphs."""
    from nanosched.kernels import reference as ref
    from nanosched.kernels.grouped_gemm import FP8_CONFIG, grouped_linear
    from nanosched.kernels.grouped_narrow import GroupedNarrowConfig, grouped_narrow_fp8

    rows, (n, k) = ids.shape[0], SHAPES[op]
    w8, wsc = ref.quantize_fp8(weights)
    x8, xs = ref.quantize_fp8(x)
    out = torch.empty(rows, n, device=x.device, dtype=torch.bfloat16)
    want = torch.empty_like(out)
    ref.grouped_linear_fp8(x8, xs, w8, wsc, ids, x_rows, want)

    def err() -> float:
        return ((out.float() - want.float()).norm() / want.float().norm()).item()

    grouped_us = graph_us(lambda: grouped_linear(x8, w8, ids, x_rows, out, FP8_CONFIG,
                                                 x_scale=xs, w_scale=wsc))
    grouped_err = err()

    def launch(bn: int, bk: int, piece: int, warps: int, stages: int, split: int):
        cfg = GroupedNarrowConfig(block_n=bn, block_k=bk, piece=piece, num_warps=warps,
                                  num_stages=stages, split_k=split)
        return lambda: grouped_narrow_fp8(x8, xs, w8, wsc, ids, x_rows, out, cfg)

    launches = {"{}x{}/p{}/w{}/s{}/k{}".format(*c): launch(*c) for c in NARROW_LAUNCHES}
    us, name, every = fastest(launches)
    launches[name]()  # the fastest's output, for its error
    weight_bytes = int((torch.bincount(ids, minlength=NUM_EXPERTS) > 0).sum()) * n * k
    flops = 2 * rows * n * k
    return {"narrow_us": us, "narrow_config": name, "narrow_us_by_config": every,
            "narrow_rel_err": err(), "narrow_tflops": flops / us / 1e6,
            "narrow_weight_tbps": weight_bytes / us / 1e6,
            "grouped_fp8_us": grouped_us, "grouped_fp8_tflops": flops / grouped_us / 1e6,
            "grouped_fp8_weight_tbps": weight_bytes / grouped_us / 1e6,
            "grouped_fp8_rel_err": grouped_err, "narrow_speedup": grouped_us / us}


def bench_shape(op: str, tokens: int, weights: torch.Tensor, kind: str, num_sms: int,
                fp8: bool = False, narrow: bool = False) -> dict:
    """Time the torch loop, dense cuBLAS and every Triton config for one op and token count."""
    from nanosched.kernels import reference as ref
    from nanosched.kernels.grouped_gemm import grouped_linear

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
    for name, cfg in _configs(TILES, num_sms):
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
    extra = fp8_shape(op, x, weights, ids, x_rows, num_sms, timed[best]) if fp8 else {}
    if narrow:
        extra |= narrow_shape(op, x, weights, ids, x_rows)
    return extra | {"op": op, "tokens": tokens, "rows": rows, "n": n, "k": k, "expert_rows": counts,
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
    ap.add_argument("--fp8", action="store_true", help="also the W8A8 grouped GEMM")
    ap.add_argument("--narrow", action="store_true",
                    help="also the narrow W8A8 grouped GEMM (kernels/grouped_narrow.py) over "
                         "NARROW_LAUNCHES beside the FP8 grouped GEMM, in CUDA graphs")
    args = ap.parse_args()
    env = environment()
    num_sms = args.num_sms or env["num_sms"]
    rows = []
    for op, (n, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(n)
        weights = (torch.randn(NUM_EXPERTS, n, k, device="cuda", generator=gen)
                   .mul_(k ** -0.5).to(torch.bfloat16))  # [E, N, K]
        for tokens in map(int, args.tokens.split(",")):
            rows.append(bench_shape(op, tokens, weights, args.routing, num_sms, args.fp8,
                                    args.narrow))
        del weights
    path = write_result("kernels_moe", {"env": env, "dtype": "bfloat16", "model": "mixtral-8x7b",
                                        "tp": 1, "routing": args.routing, "tiles": TILES,
                                        "fp8": args.fp8, "fp8_tiles": FP8_TILES if args.fp8
                                        else None,
                                        "narrow": args.narrow, "narrow_launches":
                                        NARROW_LAUNCHES if args.narrow else None,
                                        "num_sms": num_sms, "rows": rows})
    print(f"{env['device']} ({env['num_sms']} SMs), persistent programs = {num_sms}, "
          f"{args.routing} routing; results in {path}")
    print_table(rows, [("op", "op", ""), ("tokens", "T", ""),
                       ("loop_tflops", "loop TF/s", ".0f"),
                       ("triton_tflops", "Triton TF/s", ".0f"),
                       ("dense_tflops", "dense cuBLAS TF/s", ".0f"),
                       ("speedup", "Triton/loop", ".2f"), ("max_rel_err", "max rel err", ".1e"),
                       ("best_config", "best config", "")]
                + ([("fp8_tflops", "FP8 TF/s", ".0f"),
                    ("fp8_dense_tflops", "dense FP8 TF/s", ".0f"),
                    ("fp8_speedup", "FP8/bf16", ".2f"), ("fp8_rel_err", "FP8 err", ".1e"),
                    ("fp8_best_config", "FP8 config", "")] if args.fp8 else [])
                + ([("grouped_fp8_us", "FP8 grouped us", ".0f"),
                    ("narrow_us", "narrow us", ".0f"), ("narrow_tflops", "narrow TF/s", ".0f"),
                    ("narrow_weight_tbps", "narrow TB/s", ".2f"),
                    ("grouped_fp8_weight_tbps", "grouped TB/s", ".2f"),
                    ("narrow_speedup", "narrow/grouped", ".2f"),
                    ("narrow_rel_err", "narrow err", ".1e"),
                    ("narrow_config", "narrow launch", "")] if args.narrow else []))


if __name__ == "__main__":
    main()
