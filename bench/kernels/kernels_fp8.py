"""GPU: the FP8 (W8A8) path's kernels at Llama-3-8B shapes against their bf16 twins.

Per token count M (256, 1,024, 2,048): each layer GEMM in bf16 (`torch.mm`) and in FP8
(`kernels.dispatch.linear_fp8`: `torch._scaled_mm`, rowwise scales, with and without fast
accumulation), with the error of each FP8 variant against the exact emulation; the producers of
the GEMMs' inputs with a bf16 and an e4m3 output (RMSNorm with residual add, SiLU·mul) and the
row quantisation before `o`, whose cost is set against `o`'s FP8 GEMM. Every time is the median
of CUDA-graph replays (20 calls a graph, so a Python call costs nothing), with the NVML clock
and power read across the GEMM rows, and the weight bytes each FP8 GEMM streams per second (what
bounds it at decode's few rows). Usage: `PYTHONPATH=. python bench/kernels/kernels_fp8.py
[--model llama3-70b] [--rows 64,128,256] [--triton-tiles] [--narrow]` (another model: its GEMM
shapes, no producer rows; --triton-tiles: the persistent Triton GEMM's W8A8 path beside
`_scaled_mm`; --narrow: the narrow W8A8 GEMM of decode-sized rows, kernels/gemm_narrow.py).
"""

# ruff: noqa: B023  (each lambda is timed at once, inside the loop iteration that made it)
from __future__ import annotations

import argparse

import torch

from bench._common import environment, fastest, graph_us, print_table, write_result
from nanosched.kernels import dispatch as K
from nanosched.kernels import reference as ref

GEMMS = ("kqv", "o", "ug", "d")  # the dense layer GEMMs, op names of models/ops.py
ROWS = (256, 1024, 2048)
OPTS = K.KernelOptions()
BF16 = torch.bfloat16



def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device="cuda") * scale).to(BF16)


def clock_power() -> tuple[float, float]:
    return float(torch.cuda.clock_rate()), torch.cuda.power_draw() / 1e3


def model_gemms(name: str) -> dict[str, tuple[int, int]]:
    """(K, N) of each dense layer GEMM of model `name` at tp = 1 (the profiler's shapes)."""
    from nanosched.models.spec import load_spec
    from nanosched.profiler.shapes import gemm_dims

    spec = load_spec(name)
    return {op: gemm_dims(spec, 1, op) for op in GEMMS}


# persistent Triton GEMM tiles timed on the W8A8 path (BLOCK_M, BLOCK_N, warps, stages; K-steps
# of 128), each on a persistent grid of one program per SM and on one program per tile
TRITON_TILES = ((64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 3),
                (256, 64, 8, 3), (64, 256, 8, 3))


def persistent_rows(x8, xs, w8, ws, out, want) -> dict:
    """The fastest persistent Triton W8A8 tile of TRITON_TILES for one GEMM: its time, name
    and error against the emulation."""
    from nanosched.kernels.gemm import GemmConfig, persistent_linear

    best = None
    for bm, bn, warps, stages in TRITON_TILES:
        for grid in (None, 1 << 20):  # one program per SM, or per tile
            cfg = GemmConfig(num_sms=grid, block_m=bm, block_n=bn, block_k=128,
                             num_warps=warps, num_stages=stages)
            us = graph_us(lambda: persistent_linear(x8, w8, None, out, cfg, xs, ws))
            if best is None or us < best[0]:
                best = (us, f"{bm}x{bn}/w{warps}/s{stages}" + ("" if grid is None else
                                                                "/per-tile"), cfg)
    persistent_linear(x8, w8, None, out, best[2], xs, ws)
    return {"triton_us": best[0], "triton_tile": best[1],
            "triton_err": ((out.float() - want.float()).norm() / want.float().norm()).item()}


# the narrow W8A8 GEMM's launches timed with --narrow (BLOCK_N, BLOCK_K, warps, stages, split K)
NARROW_CONFIGS = ((64, 128, 4, 4, 1), (64, 128, 4, 4, 2), (64, 128, 4, 4, 4), (64, 128, 8, 4, 2),
                  (128, 128, 4, 4, 1), (128, 128, 8, 4, 1), (128, 128, 8, 3, 2),
                  (128, 128, 8, 4, 2), (128, 128, 8, 4, 4), (64, 256, 4, 3, 2),
                  (256, 128, 8, 3, 1), (128, 256, 8, 2, 1))


# the fp8 columns name torch._scaled_mm: the default W8A8 GEMM is the narrow one at some rows
SCALED_MM = {"impl": "cublas"}


def narrow_rows(x8, xs, w8, ws, out, want) -> dict:
    """The fastest launch of NARROW_CONFIGS of the narrow W8A8 GEMM for one GEMM (a launch
    that does not fit an SM's shared memory is skipped): its time, name and error, and every
    launch's time."""
    from nanosched.kernels.gemm_narrow import NarrowConfig, narrow_linear_fp8

    def launch(bn: int, bk: int, warps: int, stages: int, split: int):
        cfg = NarrowConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                           split_k=split)
        return lambda: narrow_linear_fp8(x8, xs, w8, ws, None, out, cfg)

    launches = {"{}x{}/w{}/s{}/k{}".format(*c): launch(*c) for c in NARROW_CONFIGS}
    us, name, every = fastest(launches)
    launches[name]()  # the fastest's output, for its error
    return {"narrow_us": us, "narrow_config": name, "narrow_every": every,
            "narrow_err": ((out.float() - want.float()).norm() / want.float().norm()).item()}


def gemm_rows(gemms: dict[str, tuple[int, int]], row_counts: tuple[int, ...],
              triton_tiles: bool = False, narrow: bool = False) -> list[dict]:
    rows = []
    for m in row_counts:
        for name, (k, n) in gemms.items():
            x, w = rand(m, k), rand(n, k, scale=k ** -0.5)
            out = torch.empty(m, n, dtype=BF16, device="cuda")
            (x8, xs), (w8, ws) = ref.quantize_fp8(x), ref.quantize_fp8(w)
            want = torch.empty_like(out)
            ref.linear_fp8(x8, xs, w8, ws, None, want)
            row = {"op": name, "rows": m,
                   "bf16_us": graph_us(lambda: torch.mm(x, w.t(), out=out))}
            default = K.FP8_FAST_ACCUM
            for fast in (False, True):
                K.FP8_FAST_ACCUM = fast
                key = "fp8_fast_us" if fast else "fp8_us"
                row[key] = graph_us(lambda: K.linear_fp8(x8, xs, w8, ws, None, out, OPTS,
                                                         SCALED_MM))
                K.linear_fp8(x8, xs, w8, ws, None, out, OPTS, SCALED_MM)
                row[key.replace("_us", "_err")] = \
                    ((out.float() - want.float()).norm() / want.float().norm()).item()
            K.FP8_FAST_ACCUM = default
            if triton_tiles:
                row |= persistent_rows(x8, xs, w8, ws, out, want)
            if narrow:
                row |= narrow_rows(x8, xs, w8, ws, out, want)
            row["clock_mhz"], row["power_w"] = clock_power()
            flops = 2 * m * k * n
            row["bf16_tflops"] = flops / row["bf16_us"] / 1e6
            row["fp8_tflops"] = flops / row["fp8_us"] / 1e6
            row["fp8_weight_tbps"] = k * n / row["fp8_us"] / 1e6
            if triton_tiles:
                row["triton_weight_tbps"] = k * n / row["triton_us"] / 1e6
            if narrow:
                row["narrow_weight_tbps"] = k * n / row["narrow_us"] / 1e6
            row["speedup"] = row["bf16_us"] / row["fp8_us"]
            row["speedup_fast"] = row["bf16_us"] / row["fp8_fast_us"]
            rows.append(row)
    return rows


def producer_rows(gemms: list[dict], row_counts: tuple[int, ...]) -> list[dict]:
    f8 = torch.float8_e4m3fn
    rows = []
    for m in row_counts:
        x, r, w = rand(m, 4096), rand(m, 4096), rand(4096)
        out, res = torch.empty_like(x), torch.empty_like(x)
        out8, sc = torch.empty(m, 4096, dtype=f8, device="cuda"), torch.empty(m, device="cuda")
        gu = rand(m, 2 * 14336)
        act, act8 = torch.empty(m, 14336, dtype=BF16, device="cuda"), \
            torch.empty(m, 14336, dtype=f8, device="cuda")
        o_fp8 = next(g["fp8_us"] for g in gemms if g["op"] == "o" and g["rows"] == m)
        rows.append({
            "rows": m,
            "rms_bf16_us": graph_us(lambda: K.rms_norm_add(x, r, w, 1e-5, out, res, OPTS)),
            "rms_fp8_us": graph_us(lambda: K.rms_norm_add(x, r, w, 1e-5, out8, res, OPTS,
                                                          out_scale=sc)),
            "silu_bf16_us": graph_us(lambda: K.silu_mul(gu, act, OPTS)),
            "silu_fp8_us": graph_us(lambda: K.silu_mul(gu, act8, OPTS, out_scale=sc)),
            "quant_o_us": graph_us(lambda: K.quantize_rows(x, out8, sc, OPTS)),
            "o_fp8_us": o_fp8})
        rows[-1]["quant_of_o"] = rows[-1]["quant_o_us"] / o_fp8
    return rows


def peaks() -> dict:
    from nanosched.profiler.timing import gemm_peak_tflops

    dev = torch.device("cuda")
    return {"bf16_8192_tflops": gemm_peak_tflops(dev), "fp8_8192_tflops":
            gemm_peak_tflops(dev, "fp8")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b", help="model whose GEMM shapes to time")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)),
                    help="comma-separated token counts M")
    ap.add_argument("--triton-tiles", action="store_true",
                    help="also time the persistent Triton GEMM's W8A8 path over TRITON_TILES")
    ap.add_argument("--narrow", action="store_true",
                    help="also time the narrow W8A8 GEMM (kernels/gemm_narrow.py) over "
                         "NARROW_CONFIGS; rows up to 256")
    args = ap.parse_args()
    row_counts = tuple(int(m) for m in args.rows.split(","))
    torch.manual_seed(0)
    shapes = model_gemms(args.model)
    gemms = gemm_rows(shapes, row_counts, args.triton_tiles, args.narrow)
    producers = producer_rows(gemms, row_counts) if args.model == "llama3-8b" else []
    peak = peaks()
    path = write_result("kernels_fp8", {"env": environment(), "model": args.model,
                                        "command": "bench/kernels/kernels_fp8.py --model "
                                        f"{args.model} --rows {args.rows}"
                                        + (" --triton-tiles" if args.triton_tiles else "")
                                        + (" --narrow" if args.narrow else ""),
                                        "gemms": gemms,
                                        "producers": producers, "peaks": peak})
    print(f"wrote {path}")
    print(f"GEMM peak at 8192^3 (50 ms from idle): bf16 {peak['bf16_8192_tflops']:.0f}, "
          f"fp8 {peak['fp8_8192_tflops']:.0f} TFLOP/s")
    print_table(gemms, [("op", "op", ""), ("rows", "M", "d"), ("bf16_us", "bf16 us", ".1f"),
                        ("fp8_us", "fp8 us", ".1f"), ("fp8_fast_us", "fast us", ".1f"),
                        ("speedup", "x", ".2f"), ("speedup_fast", "x fast", ".2f"),
                        ("fp8_weight_tbps", "w TB/s", ".2f"),
                        *([("triton_us", "triton us", ".1f"), ("triton_weight_tbps",
                                                                "triton TB/s", ".2f"),
                           ("triton_tile", "tile", "")] if args.triton_tiles else []),
                        *([("narrow_us", "narrow us", ".1f"), ("narrow_weight_tbps",
                                                              "narrow TB/s", ".2f"),
                           ("narrow_config", "narrow", ""), ("narrow_err", "n err", ".1e")]
                          if args.narrow else []),
                        ("fp8_err", "err", ".1e"), ("fp8_fast_err", "err fast", ".1e"),
                        ("clock_mhz", "MHz", ".0f"), ("power_w", "W", ".0f")])
    if producers:
        print_table(producers, [
            ("rows", "M", "d"), ("rms_bf16_us", "rms bf16", ".1f"),
            ("rms_fp8_us", "rms fp8", ".1f"), ("silu_bf16_us", "silu bf16", ".1f"),
            ("silu_fp8_us", "silu fp8", ".1f"), ("quant_o_us", "quant o", ".1f"),
            ("o_fp8_us", "o fp8", ".1f"), ("quant_of_o", "quant/o", ".3f")])


if __name__ == "__main__":
    main()
