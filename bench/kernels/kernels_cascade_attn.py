"""Cascade decode attention against the engine's default decode attention, shared prefixes.

    PYTHONPATH=. python bench/kernels/kernels_cascade_attn.py [--groups 10] [--rows 100]
        [--prefix 2000] [--own 328] [--kv-dtype auto,fp8] [--decode-kernels K1,K2]
        [--suffix-configs C1,C2] [--ctas-per-sm 2,4] [--parts]

Llama-3-8B heads (Hq 32, Hkv 8, d 128), page 16, bf16 queries, pages shuffled, random data:
`--groups` groups of `--rows` requests, each group's requests sharing a `--prefix`-token prompt
(whole pages), each request with `--own` tokens of its own (200 unique + 128 decoded). Times
`dispatch.decode_attention` (KernelOptions() defaults: what the engine launches) reading every
row's full context, and `cascade_attn.cascade_decode_attention` (PREFIXES x PREFIX_SPLITS), as
medians of CUDA-graph replays (`graph_us`, 20 calls a graph), after checking both against the
fp32 reference. `--decode-kernels` times other decode attentions over the full contexts beside
the default; `--suffix-configs` x `--ctas-per-sm` the suffix kernel (a Triton DecodeConfig, or
cuda_bulk) and the grid bound, with the fastest prefix tile; `--parts` each cascade launch
alone (prefix, suffix from the starts the prefix launch wrote, merge, and merge with one (row,
head) a work item instead of a block of heads), each in its own graph. Bytes: the K/V (+
scales) each must read, q and out, and the cascade's fp32 partials (written, read);
`prefix_tile_gb` is the prefix bytes times tiles per group, what the prefix kernel reads where
L2 serves no tile. TB/s = a kernel's bytes / its time. JSON through bench._common.write_result;
table last.
"""

# ruff: noqa: B023  (each lambda is timed at once, inside the loop iteration that made it)
from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import astuple

import torch

from bench._common import environment, graph_us, print_table, write_result
from nanosched.kernels import decode_attn
from nanosched.kernels import dispatch as K
from nanosched.kernels import reference as ref
from nanosched.kernels.cascade_attn import (
    CascadeGroups,
    PrefixConfig,
    cascade_launches,
)
from nanosched.kernels.common import PIPELINED, num_sms
from nanosched.kernels.impls import DECODE_CONFIGS

HQ, HKV, HD, PAGE = 32, 8, 128, 16
DEVICE = "cuda"
OPTS = K.KernelOptions()
# prefix tiles timed: M (rows x 4 query heads), tokens per step, stages, warps
PREFIXES = (PrefixConfig(64, 64, 2, 4), PrefixConfig(64, 32, 3, 4), PrefixConfig(128, 64, 2, 8),
            PrefixConfig(128, 32, 3, 8), PrefixConfig(32, 64, 3, 4), PrefixConfig(64, 128, 2, 4),
            PrefixConfig(128, 128, 2, 8))
PREFIX_SPLITS = (None, 4)  # the planned prefix splits, or more (shorter prefix work items)
DEFAULT_SUFFIX = "triton_pipelined"  # the Triton suffix kernel's DecodeConfig
BULK = "cuda_bulk"  # the suffix read by decode_attn_bulk (the engine's choice over e4m3)



def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def make_batch(groups: int, rows: int, prefix: int, own: int, kv_dtype: str):
    """q, cache (+ scales), block tables (shared prefix pages per group), lengths."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    p_pages, o_pages = prefix // PAGE, math.ceil(own / PAGE)
    num_pages = groups * p_pages + groups * rows * o_pages
    perm = torch.randperm(num_pages, device=DEVICE, generator=gen).int()
    shared = perm[:groups * p_pages].view(groups, 1, p_pages).expand(groups, rows, p_pages)
    mine = perm[groups * p_pages:].view(groups, rows, o_pages)
    tables = torch.cat([shared, mine], dim=2).reshape(groups * rows, p_pages + o_pages)
    k = torch.randn(num_pages, PAGE, HKV, HD, device=DEVICE, generator=gen)
    v = torch.randn(num_pages, PAGE, HKV, HD, device=DEVICE, generator=gen)
    if kv_dtype == "fp8":
        (kc, ks), (vc, vs) = ref.quantize_fp8(k), ref.quantize_fp8(v)
        scales = {"k_scale": ks, "v_scale": vs}
    else:
        kc, vc, scales = k.bfloat16(), v.bfloat16(), {}
    del k, v
    n = groups * rows
    q = torch.randn(n, HQ, HD, device=DEVICE, generator=gen).bfloat16()
    lens = torch.full((n,), prefix + own, dtype=torch.int32, device=DEVICE)
    return q, kc, vc, tables.contiguous(), lens, scales


def token_bytes(kv_dtype: str) -> int:
    """K + V bytes of one token (all KV heads), with the FP8 cache's fp32 scales."""
    return 2 * HKV * (HD * (1 if kv_dtype == "fp8" else 2) + (4 if kv_dtype == "fp8" else 0))


def measure(args: argparse.Namespace, kv_dtype: str) -> list[dict]:
    q, kc, vc, tables, lens, scales = make_batch(args.groups, args.rows, args.prefix, args.own,
                                                 kv_dtype)
    n, ctx, scale = q.shape[0], args.prefix + args.own, HD ** -0.5
    want = torch.empty(q.shape, device=DEVICE)
    for i in range(0, n, 50):  # the fp32 reference in slices (its gathered K/V are large)
        ref.decode_attention(q[i:i + 50].float(), kc, vc, tables[i:i + 50], lens[i:i + 50], ctx,
                             scale, want[i:i + 50], **scales)
    out = torch.empty_like(q)
    io = 2 * n * HQ * HD * q.element_size()  # q in, out back
    tok = token_bytes(kv_dtype)
    impl = K._default_decode(OPTS, q, kc, vc, scales.get("k_scale"), scales.get("v_scale"))
    decode_gb = (n * ctx * tok + io) / 1e9
    rows = []
    for name in dict.fromkeys([impl, *args.decode_kernels]):  # the default first
        launch = None if name == impl else {"impl": name}
        K.decode_attention(q, kc, vc, tables, lens, ctx, scale, out, OPTS, launch, **scales)
        us = graph_us(lambda: K.decode_attention(q, kc, vc, tables, lens, ctx, scale, out,
                                                 OPTS, launch, **scales))
        rows.append({"kv": kv_dtype, "kernel": f"decode {name}", "us": us, "gb": decode_gb,
                     "tbps": decode_gb / us * 1e3, "err": rel_err(out, want),
                     "speedup": rows[0]["us"] / us if rows else 1.0})
    decode_us = rows[0]["us"]
    groups = CascadeGroups.build([args.rows] * args.groups, [args.prefix] * args.groups, PAGE,
                                 DEVICE)
    kv = args.groups * args.prefix * tok + n * args.own * tok

    def time_cascade(pc: PrefixConfig, ps: int | None, suffix: str, ctas_per_sm: int) -> dict:
        config, max_ctas = DECODE_CONFIGS.get(suffix, PIPELINED), ctas_per_sm * num_sms(q.device)
        call = cascade_launches(q, kc, vc, tables, lens, ctx, scale, out, groups,
                                max_suffix_len=args.own, max_ctas=max_ctas, prefix_splits=ps,
                                config=config, prefix=pc, **scales,
                                suffix_impl="cuda_bulk" if suffix == BULK else "triton")
        plan = call.plan
        partial = 2 * n * HQ * (plan.p_splits + plan.s_splits) * (HD + 1) * 4  # fp32 + LSE,
        gb = (kv + io + partial) / 1e9  # written then read
        out.fill_(float("nan"))
        call()
        us = graph_us(call)
        parts = {}
        if args.parts:  # each launch alone, and the merge with one (row, head) a work item
            parts = {f"{part}_us": graph_us(getattr(call, part))
                     for part in ("prefix", "suffix", "merge")}
            tile, decode_attn.MERGE_TILE = decode_attn.MERGE_TILE, 1
            try:
                parts["merge_one_head_us"] = graph_us(call.merge)
            finally:
                decode_attn.MERGE_TILE = tile
        return {**parts, "kv": kv_dtype, "kernel": f"cascade m{pc.block_m}/n{pc.block_n}/"
                f"s{pc.num_stages}/w{pc.num_warps}/p{plan.p_splits} {suffix}/c{ctas_per_sm}",
                "us": us, "gb": gb, "tbps": gb / us * 1e3, "err": rel_err(out, want),
                "speedup": decode_us / us, "kv_gb": kv / 1e9, "partial_gb": partial / 1e9,
                "prefix_tile_gb": args.groups * plan.num_tiles * args.prefix * tok / 1e9,
                "tiles": plan.num_tiles, "prefix_splits": plan.p_splits,
                "suffix_splits": plan.s_splits, "prefix_config": list(astuple(pc)),
                "prefix_splits_asked": ps, "suffix_config": suffix,
                "ctas_per_sm": ctas_per_sm}

    swept = [time_cascade(pc, ps, DEFAULT_SUFFIX, PIPELINED.ctas_per_sm)
             for pc, ps in itertools.product(PREFIXES, PREFIX_SPLITS)]
    best = min(swept, key=lambda r: r["us"])
    pc, ps = PrefixConfig(*best["prefix_config"]), best["prefix_splits_asked"]
    rows += swept
    rows += [time_cascade(pc, ps, suffix, c) for suffix, c in
             itertools.product(args.suffix_configs, args.ctas_per_sm)
             if (suffix, c) != (DEFAULT_SUFFIX, PIPELINED.ctas_per_sm)]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=10, help="groups sharing a prefix")
    ap.add_argument("--rows", type=int, default=100, help="requests per group")
    ap.add_argument("--prefix", type=int, default=2000, help="shared tokens (whole pages)")
    ap.add_argument("--own", type=int, default=328, help="each request's own tokens")
    ap.add_argument("--kv-dtype", default="auto,fp8", help="comma-separated: auto (bf16), fp8")
    ap.add_argument("--decode-kernels", default="triton_pipelined",
                    help="comma-separated decode attentions timed beside the default "
                         "(dispatch impl names, e.g. triton_pipelined,cuda_bulk)")
    ap.add_argument("--suffix-configs", default="triton_pipelined,triton_pipelined_2w,cuda_bulk",
                    help="comma-separated suffix kernels timed with the fastest prefix tile: "
                         "DecodeConfigs of the Triton one (impls.DECODE_CONFIGS) or cuda_bulk")
    ap.add_argument("--ctas-per-sm", default="2,4",
                    help="comma-separated cascade grid bounds, programs per SM, timed with "
                         "each suffix config")
    ap.add_argument("--parts", action="store_true",
                    help="also time each cascade launch alone: prefix, suffix, merge")
    args = ap.parse_args()
    args.decode_kernels = [k for k in args.decode_kernels.split(",") if k]
    args.suffix_configs = [k for k in args.suffix_configs.split(",") if k]
    bad = [k for k in args.suffix_configs if k not in DECODE_CONFIGS and k != BULK]
    if bad:
        ap.error(f"--suffix-configs {bad}: not one of {sorted(DECODE_CONFIGS)} or {BULK}")
    args.ctas_per_sm = [int(c) for c in args.ctas_per_sm.split(",") if c]
    if args.prefix % PAGE:
        ap.error(f"--prefix {args.prefix} is not a multiple of the page size {PAGE}")
    torch.manual_seed(0)
    rows = [r for kv in args.kv_dtype.split(",") for r in measure(args, kv)]
    path = write_result("kernels_cascade_attn", {
        "env": environment(), "command": "bench/kernels/kernels_cascade_attn.py --groups "
        f"{args.groups} --rows {args.rows} --prefix {args.prefix} --own {args.own} "
        f"--kv-dtype {args.kv_dtype} --decode-kernels {','.join(args.decode_kernels) or ','}"
        f" --suffix-configs {','.join(args.suffix_configs)} --ctas-per-sm "
        f"{','.join(map(str, args.ctas_per_sm))}" + (" --parts" if args.parts else ""),
        "shape": {"hq": HQ, "hkv": HKV, "d": HD, "page": PAGE}, "rows": rows})
    print(f"wrote {path}")
    parts = [(f"{p}_us", f"{p} us", ".1f") for p in ("prefix", "suffix", "merge", "merge_one_head")]
    print_table([{**dict.fromkeys(k for k, _, _ in parts), **r} for r in rows],
                [("kv", "kv", ""), ("kernel", "kernel", ""), ("us", "us", ".1f"),
                 ("gb", "GB read", ".3f"), ("tbps", "TB/s", ".2f"),
                 ("speedup", "x decode", ".2f"), ("err", "err", ".1e"),
                 *(parts if args.parts else [])])


if __name__ == "__main__":
    main()
