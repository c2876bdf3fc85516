"""`cuda_bulk`'s shared-memory ring shapes against each other on the decode-attention grid.

    PYTHONPATH=. python bench/kernels/kernels_decode_bulk_ring.py [--rings 3x4,6x2,7x2,12x1,14x1]
                                             [--requests 64,256,640] [--contexts 1024,4096,8192]
                                             [--sms 16,32,48]

A ring `SxB` is S slots of B boxes, a box being one tensor copy of 64 dims x 16 tokens x 8 KV
heads of K or V (16 KB; a page's K and V are four). A slot is given back when its last box is
read: 3x4 is a ring of three whole pages, each given back after its P.V (the kernel's ring until
2026-11-25); 6x2 (the default) and 7x2 give a page's K back after S and its V after P.V; 12x1
and 14x1 each 64-dim box after the products that read it. Every ring computes the same products
in the same order, so each output (whole GPU) should equal the first ring's bit for bit; each row
records whether it does, its largest difference and its NaNs. Batches, partitions, timing and
the copy ceiling are those of kernels_decode_attn.py. JSON to $OUT or bench/results/; table last.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from bench._common import environment, print_table, write_result
from bench.kernels.kernels_decode_attn import Batch, copy_bandwidth_gbs, places, time_on
from nanosched.kernels import decode_attn_bulk as bulk

BOX_BYTES = 64 * 16 * 8 * 2  # 64 dims x 16 tokens x 8 KV heads, bf16


def use_ring(ring: str) -> tuple[int, int]:
    """Make `cuda_bulk` launch ring 'SxB' (Llama-3-8B heads); returns (S, B)."""
    slots, boxes = (int(x) for x in ring.split("x"))
    bulk.SLOT_BOXES, bulk.RING_BYTES = boxes, slots * boxes * BOX_BYTES
    return slots, boxes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rings", default="3x4,6x2,7x2,12x1,14x1")
    ap.add_argument("--requests", default="64,256,640")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--sms", default="16,32,48")
    ap.add_argument("--kernel", default="cuda_bulk", choices=["cuda_bulk", "cuda_bulk_consume"],
                    help="cuda_bulk_consume: the ring's consumers read nothing (its copy "
                    "ceiling; outputs are zeros)")
    args = ap.parse_args()
    env = environment()
    copy_gbs = copy_bandwidth_gbs()
    where = places([int(s) for s in args.sms.split(",")])
    rings = args.rings.split(",")
    rows = []
    for n, ctx in itertools.product([int(x) for x in args.requests.split(",")],
                                    [int(x) for x in args.contexts.split(",")]):
        batch = Batch(n, ctx)
        first = None
        for ring in rings:
            slots, boxes = use_ring(ring)
            torch.cuda.synchronize()
            got = batch.run(args.kernel, where[-1][0]).clone()
            torch.cuda.synchronize()
            first = got if first is None else first
            check = {"equal": torch.equal(got, first), "nan": int(got.isnan().sum()),
                     "max_diff": float((got.float() - first.float()).abs().max())}
            for sms, stream, _ in where:
                r = time_on(batch, args.kernel, sms, stream)
                rows.append({"kernel": args.kernel, "ring": ring, "slots": slots,
                             "slot_boxes": boxes, "requests": n, "context": ctx, "sms": sms,
                             **check, **r,
                             "pct_of_copy": 100 * r["gbs"] / copy_gbs})
        del batch, first
        torch.cuda.empty_cache()
    path = write_result("kernels_decode_bulk_ring", {
        "env": env, "copy_gbs": copy_gbs, "rings": rings,
        "shapes": {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "page_size": 16,
                   "dtype": "bfloat16"}, "rows": rows})
    print(f"{env['device']}: copy {copy_gbs:.0f} GB/s; {path}")
    if not all(r["equal"] for r in rows):
        print("OUTPUTS DIFFER:", sorted({(r["ring"], r["requests"], r["context"], r["nan"],
                                         r["max_diff"]) for r in rows if not r["equal"]}))
    summary = {}
    for r in rows:
        summary.setdefault((r["sms"], rings.index(r["ring"])), []).append(r["pct_of_copy"])
    print_table([{"ring": rings[i], "sms": s, "min": min(v), "max": max(v),
                  "mean": sum(v) / len(v)} for (s, i), v in sorted(summary.items())],
                [("ring", "ring", ""), ("sms", "SMs", ""), ("min", "min % copy", ".1f"),
                 ("max", "max % copy", ".1f"), ("mean", "mean", ".1f")])
    for _, _, pair in where:
        if pair is not None:
            pair.close()


if __name__ == "__main__":
    main()
