"""Triton paged prefill attention vs the torch path, at Llama-3-8B and Llama-3-70B tp=8 heads.

    PYTHONPATH=. python bench/kernels/kernels_prefill_attn.py [--models llama3-8b,llama3-70b-tp8]
        [--cases all|NAME,...] [--page 16] [--kv-dtype bf16|fp8] [--configs BMxBNwWsS,...]
        [--no-sweep]

Heads (Hq, Hkv, d): llama3-8b (32, 8, 128); llama3-70b-tp8 (8, 1, 128). Cases (bf16, paged
cache of page 16 with shuffled pages): fresh prompts of 512 / 1024 / 2048 tokens and four of
512 (2048 tokens); chunks continuing a cached prefix: the last 512 tokens of prompts of 1024 and
2048, the last 1024 of 2048, and four such 512-token chunks (2048 tokens, four requests).
Per case: the torch path (`reference.prefill_attention`: per segment a gather of its pages, K/V
repeated over the query group, SDPA; its Python loop is part of its time), the Triton kernel at
its default tiles with prebuilt device segments (what the runtime launches) and with the
(start, end, first_pos) list (one H2D copy per call), and a sweep of tile configs
(BLOCK_M x BLOCK_N, warps, stages; a trailing 'a': page ids a tile ahead). TFLOP/s count
causal FLOPs: 4 · d · Hq per (query, key it sees). Medians of triton.testing.do_bench, random
data; every Triton result is checked against
the torch path (relative L2 error). `--kv-dtype fp8` stores the cache in e4m3 with a scale per
(token, KV head), as the engine's FP8 KV cache does (the torch path then dequantises). Beside
them, a ceiling: torch SDPA on contiguous bf16 q/k/v of one fresh prompt (`is_causal`, GQA;
flash attention where torch has it), for the single-segment fresh cases. JSON to $OUT or
bench/results/; a table last.
"""

from __future__ import annotations

import argparse
import math

import torch

from bench._common import environment, median_ms, print_table, write_result

MODELS = {"llama3-8b": (32, 8, 128), "llama3-70b-tp8": (8, 1, 128)}
CASES = {  # name: segments (start, end, first_pos)
    "fresh512": [(0, 512, 0)],
    "fresh1024": [(0, 1024, 0)],
    "fresh2048": [(0, 2048, 0)],
    "fresh4x512": [(i * 512, (i + 1) * 512, 0) for i in range(4)],
    "cont512of1024": [(0, 512, 512)],
    "cont512of2048": [(0, 512, 1536)],
    "cont1024of2048": [(0, 1024, 1024)],
    "cont4x512of2048": [(i * 512, (i + 1) * 512, 1536) for i in range(4)],
}
SWEEP = ["128x64w8s2", "128x64w4s3", "128x64w8s3", "128x128w8s2", "64x64w4s3", "64x64w4s2",
         "128x32w4s3", "64x128w4s2", "128x128w8s3", "64x128w4s3", "128x64w4s4", "64x64w4s4",
         "64x64w4s3a", "64x128w4s2a", "64x128w4s3a", "128x64w8s3a"]


def parse_config(text: str):
    """'128x64w8s2' -> PrefillConfig(128, 64, 8, 2); a trailing 'a' loads each K/V tile's
    page ids a tile ahead (PrefillConfig.pages_ahead)."""
    from nanosched.kernels.prefill_attn import PrefillConfig

    ahead = text.endswith("a")
    tiles, rest = text.removesuffix("a").split("w")
    bm, bn = tiles.split("x")
    warps, stages = rest.split("s")
    return PrefillConfig(int(bm), int(bn), int(warps), int(stages), pages_ahead=ahead)


def config_name(cfg) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}"
            + ("a" if cfg.pages_ahead else ""))


def causal_flops(segments, num_heads: int, head_dim: int) -> float:
    """4 · d · Hq per (query, visible key): a row at position p sees p + 1 keys."""
    pairs = sum((e - s) * p + (e - s) * (e - s + 1) / 2 for s, e, p in segments)
    return 4.0 * head_dim * num_heads * pairs


def make_case(segments, heads, page: int, gen: torch.Generator):
    """q, k_cache, v_cache (bf16, shuffled pages), block tables, out."""
    hq, hkv, d = heads
    need = [math.ceil((p + e - s) / page) for s, e, p in segments]
    num_pages = sum(need)
    kc = torch.randn(num_pages, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    perm = torch.randperm(num_pages, device="cuda", generator=gen).int()
    tables = torch.zeros(len(segments), max(need), dtype=torch.int32, device="cuda")
    at = 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[at:at + k]
        at += k
    q = torch.randn(segments[-1][1], hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, kc, vc, tables, torch.empty_like(q)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def sdpa_ceiling_ms(segments, heads, gen: torch.Generator) -> float | None:
    """torch SDPA on contiguous bf16 q/k/v [1, H, L, d] of one fresh prompt (None otherwise)."""
    import torch.nn.functional as F

    if len(segments) != 1 or segments[0][2] != 0:
        return None
    hq, hkv, d = heads
    length = segments[0][1] - segments[0][0]
    q = torch.randn(1, hq, length, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, hkv, length, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    return median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True))


def bench_case(model: str, case: str, page: int, configs: list, kv_dtype: str = "bf16") -> dict:
    from nanosched.kernels import reference as ref
    from nanosched.kernels.common import PrefillSegments
    from nanosched.kernels.prefill_attn import default_config, prefill_attention

    heads = MODELS[model]
    segments = CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, kc, vc, tables, out = make_case(segments, heads, page, gen)
    scales = {}
    if kv_dtype == "fp8":  # e4m3 with a scale per (token, KV head), as models/kvcache.py holds it
        (kc, ks), (vc, vs) = ref.quantize_fp8(kc), ref.quantize_fp8(vc)
        scales = {"k_scale": ks, "v_scale": vs}
    scale = heads[2] ** -0.5
    flops = causal_flops(segments, heads[0], heads[2])
    want = torch.empty_like(q)
    torch_ms = median_ms(lambda: ref.prefill_attention(q, kc, vc, tables, segments, scale,
                                                       want, **scales))
    meta = PrefillSegments.build(segments, "cuda")
    default = default_config(q.dtype, kv_dtype == "fp8")  # what the engine launches
    row = {"model": model, "case": case, "tokens": segments[-1][1], "kv_dtype": kv_dtype,
           "segments": len(segments), "flops": flops, "torch_us": 1e3 * torch_ms,
           "torch_tflops": flops / torch_ms / 1e9, "default_config": config_name(default)}
    ceiling_ms = sdpa_ceiling_ms(segments, heads, gen)
    if ceiling_ms is not None:
        row.update({"sdpa_bf16_us": 1e3 * ceiling_ms, "sdpa_bf16_tflops": flops / ceiling_ms / 1e9})
    list_ms = median_ms(lambda: prefill_attention(q, kc, vc, tables, segments, scale, out,
                                                  **scales))
    row["triton_list_us"] = 1e3 * list_ms
    sweep = []
    for cfg in [default] + [c for c in configs if c != default]:
        try:
            ms = median_ms(lambda cfg=cfg: prefill_attention(q, kc, vc, tables, meta, scale, out,
                                                             cfg, **scales))
        except Exception as exc:  # e.g. out of shared memory for this tile
            sweep.append({"config": config_name(cfg), "error": f"{type(exc).__name__}: {exc}"})
            continue
        sweep.append({"config": config_name(cfg), "us": 1e3 * ms,
                      "tflops": flops / ms / 1e9, "rel_err": rel_err(out, want)})
    ok = [s for s in sweep if "us" in s]
    if not ok:
        raise RuntimeError(f"{model} {case}: every tile config failed: {sweep}")
    best = min(ok, key=lambda s: s["us"])
    row.update({"triton_us": sweep[0].get("us", float("nan")),  # the default tiles
                "best_us": best["us"], "best_config": best["config"],
                "best_tflops": best["tflops"], "max_rel_err": max(s["rel_err"] for s in ok),
                "speedup": row["torch_us"] / best["us"], "sweep": sweep})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    ap.add_argument("--cases", default="all", help=f"'all' or of {', '.join(CASES)}")
    ap.add_argument("--page", type=int, default=16, help="KV page size (tokens)")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                    help="the cache's dtype (fp8: e4m3, a scale per token and KV head)")
    ap.add_argument("--configs", default=",".join(SWEEP),
                    help="tile configs BMxBNwWARPSsSTAGES, comma-separated")
    ap.add_argument("--no-sweep", action="store_true", help="default tiles only")
    args = ap.parse_args()
    models = args.models.split(",")
    cases = list(CASES) if args.cases == "all" else args.cases.split(",")
    bad = [m for m in models if m not in MODELS] + [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"unknown model(s)/case(s): {bad}")
    configs = [] if args.no_sweep else [parse_config(c) for c in args.configs.split(",")]
    env = environment()
    rows = []
    for model in models:
        for case in cases:
            rows.append(bench_case(model, case, args.page, configs, args.kv_dtype))
            torch.cuda.empty_cache()
    path = write_result("kernels_prefill_attn", {
        "env": env, "shapes": {"models": {m: MODELS[m] for m in models}, "page_size": args.page,
                               "dtype": "bfloat16", "kv_dtype": args.kv_dtype,
                               "cases": {c: CASES[c] for c in cases}},
        "rows": rows})
    print(f"{env['device']}: results in {path}")
    print_table([{"model": r["model"], "case": r["case"], **s} for r in rows
                 for s in r["sweep"] if "us" in s],
                [("model", "model", ""), ("case", "case", ""), ("config", "tiles", ""),
                 ("us", "µs", ".1f"), ("tflops", "TFLOP/s", ".0f"), ("rel_err", "err", ".1e")])
    print()
    print_table([{"sdpa_bf16_tflops": "-"} | r for r in rows], [
                       ("model", "model", ""), ("case", "case", ""), ("tokens", "T", ""),
                       ("torch_us", "torch µs", ".1f"), ("triton_us", "triton µs", ".1f"),
                       ("triton_list_us", "+H2D µs", ".1f"), ("best_us", "best µs", ".1f"),
                       ("best_config", "best tiles", ""), ("best_tflops", "TFLOP/s", ".0f"),
                       ("torch_tflops", "torch TF/s", ".0f"), ("speedup", "x torch", ".2f"),
                       ("sdpa_bf16_tflops", "SDPA bf16 TF/s", ".0f")])


if __name__ == "__main__":
    main()
