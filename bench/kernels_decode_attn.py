"""Decode-attention bandwidth vs CTA count at Llama-3-8B shapes, beside a copy ceiling.

    python bench/kernels_decode_attn.py [--requests 256] [--contexts 1024,4096] [--ctas ...]

For each context length: 256 requests × context tokens of paged bf16 K/V (Hkv = 8, d = 128,
Hq = 32, page 16, pages shuffled), the Triton decode kernel at each `max_ctas`, bandwidth =
K/V bytes read / median time. The ceiling is a device-to-device copy (read + write bytes / time)
of a buffer larger than L2, measured in the same run. Inputs are rotated over enough copies to
exceed 2× L2 when one copy would fit in it. Reports the smallest CTA counts that reach 50% and
80% of the copy bandwidth. JSON to $OUT or bench/results/; a table last.
"""

from __future__ import annotations

import argparse
import math

import torch
from _common import environment, l2_bytes, median_ms, print_table, write_result

HQ, HKV, HD, PAGE = 32, 8, 128, 16
DEFAULT_CTAS = [4, 8, 16, 24, 32, 48, 64, 96, 132, 176, 264, 396, 528, 1056]


def copy_bandwidth_gbs(nbytes: int = 2**31) -> dict[str, float]:
    """Device-to-device copy: (read + write bytes) / median time."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return {"bytes": nbytes, "ms": ms, "gbs": 2 * nbytes / ms / 1e6}


def make_inputs(requests: int, context: int, copies: int, gen: torch.Generator):
    """`copies` independent (q, k_cache, v_cache, tables, lens, out) sets with random data."""
    pages_per = math.ceil(context / PAGE)
    sets = []
    for _ in range(copies):
        num_pages = requests * pages_per
        k = torch.randn(num_pages, PAGE, HKV, HD, device="cuda", dtype=torch.bfloat16,
                        generator=gen)
        v = torch.randn_like(k)
        perm = torch.randperm(num_pages, device="cuda", generator=gen).int()
        tables = perm.view(requests, pages_per)
        lens = torch.full((requests,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(requests, HQ, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
        sets.append((q, k, v, tables, lens, torch.empty_like(q)))
    return sets


def bench_context(requests: int, context: int, ctas: list[int]) -> list[dict]:
    from nanosched.kernels.decode_attn import decode_attention, plan_splits

    kv_bytes = 2 * requests * context * HKV * HD * 2  # K and V, bf16
    copies = max(1, math.ceil(2 * l2_bytes() / kv_bytes))
    sets = make_inputs(requests, context, copies, torch.Generator(device="cuda").manual_seed(0))
    rows = []
    for n in ctas:
        state = {"i": 0}

        def run(n=n, state=state):
            q, k, v, tables, lens, out = sets[state["i"] % copies]
            state["i"] += 1
            decode_attention(q, k, v, tables, lens, context, HD ** -0.5, out, max_ctas=n)

        ms = median_ms(run)
        splits, _ = plan_splits(requests, HKV, context, n)
        rows.append({"context": context, "max_ctas": n, "num_splits": splits, "ms": ms,
                     "gbs": kv_bytes / ms / 1e6, "copies": copies})
    sets.clear()
    torch.cuda.empty_cache()
    return rows


def thresholds(rows: list[dict], ceiling: float) -> dict[str, int | None]:
    """Smallest max_ctas reaching 50% / 80% of the copy bandwidth (None if never)."""
    res = {}
    for frac in (0.5, 0.8):
        hits = [r["max_ctas"] for r in rows if r["gbs"] >= frac * ceiling]
        res[f"ctas_for_{int(frac * 100)}pct"] = min(hits) if hits else None
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--ctas", default=",".join(map(str, DEFAULT_CTAS)))
    args = ap.parse_args()
    env = environment()
    ceiling = copy_bandwidth_gbs()
    rows, summary = [], []
    for context in map(int, args.contexts.split(",")):
        part = bench_context(args.requests, context, [int(c) for c in args.ctas.split(",")])
        for r in part:
            r["pct_of_copy"] = 100 * r["gbs"] / ceiling["gbs"]
        rows += part
        summary.append({"context": context, **thresholds(part, ceiling["gbs"]),
                        "best_gbs": max(r["gbs"] for r in part)})
    path = write_result("kernels_decode_attn", {
        "env": env, "shapes": {"requests": args.requests, "num_heads": HQ,
                               "num_kv_heads": HKV, "head_dim": HD, "page_size": PAGE,
                               "dtype": "bfloat16"},
        "copy_ceiling": ceiling, "rows": rows, "summary": summary})
    print(f"{env['device']}: copy ceiling {ceiling['gbs']:.0f} GB/s; results in {path}")
    print_table(rows, [("context", "context", ""), ("max_ctas", "CTAs", ""),
                       ("num_splits", "splits", ""), ("ms", "ms", ".3f"),
                       ("gbs", "GB/s", ".0f"), ("pct_of_copy", "% copy", ".1f")])
    print_table(summary, [("context", "context", ""), ("ctas_for_50pct", "CTAs@50%", ""),
                          ("ctas_for_80pct", "CTAs@80%", ""), ("best_gbs", "best GB/s", ".0f")])


if __name__ == "__main__":
    main()
