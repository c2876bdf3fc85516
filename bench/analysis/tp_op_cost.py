"""CPU: what a layer of Llama-3-8B costs per GPU at tp = 2 against tp = 1, op by op.

Per-GPU throughput at tp = N is tp = 1's when each rank's layer takes 1/N of tp = 1's. Two
profiles of the same host, measured at the same time, give each op's time alone on the whole
GPU (the fastest implementation, `sms` = all): tp = 1 and tp = 2 (a `.partial.json` is read as
well: its kernel rows are whole). A batch of `--tokens` rows, `--decode` of them decode rows of
`--context` cached tokens and the rest prompt tokens, is priced op by op: every token op at
`--tokens`, `attn_decode` at the decode rows and context (interpolated linearly between the
grid's points), `attn_prefill` at the prompt tokens (the grid's nearest context). The two NCCL
all-reduces of a tp = 2 layer ([tokens, hidden] bf16 each, `ar_attn` and `ar_ffn`) are priced
from a `bench/kernels/ce_allreduce.py --world 2` record's NCCL rows alone (graph-timed; its
rows are [T, 8192] bf16, so interpolated linearly in bytes).

Per op: its time at tp = 1 and at tp = 2, and the per-GPU cost ratio 2 x tp2 / tp1 (1: the op
shards perfectly). The layer's per-GPU efficiency tp1 / (2 x tp2) with and without the
all-reduces says how much of a tp = 2 engine's per-GPU loss is the network and how much is
work that does not halve (norms and residual adds run on every rank over all tokens; narrower
GEMMs run at a lower rate).

    python bench/analysis/tp_op_cost.py \\
        --tp1 bench/results/profile-llama3-8b-tp1-h100-quick-20261127.json \\
        --tp2 bench/results/profile-llama3-8b-tp2-h100-quick-20261127.partial.json \\
        --nccl bench/results/ce_allreduce-NVIDIA_H100_80GB_HBM3-2gpu-20261127T003948.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 4096  # Llama-3-8B
NCCL_HIDDEN = 8192  # ce_allreduce.py's rows: [T, 8192] bf16
TOKEN_OPS = ("kqv", "rope_append", "o", "add_norm_ffn", "ug", "act", "d", "add_norm_attn")


def kernel_rows(path: Path) -> list[dict[str, Any]]:
    """A profile's kernel rows as dicts (a profile, or a partial profile's field lists)."""
    data = json.loads(path.read_text())
    if "kernel_fields" in data:
        return [dict(zip(data["kernel_fields"], r, strict=True)) for r in data["kernels"]]
    return data["kernels"]


def best_times(rows: list[dict[str, Any]]) -> dict[tuple[str, int, int], float]:
    """(op, tokens, context) -> the fastest implementation's time (us) on all SMs."""
    full = max(r["sms"] for r in rows)
    out: dict[tuple[str, int, int], float] = {}
    for r in rows:
        if r["sms"] == full and not r.get("modelled"):
            key = (r["op"], r["tokens"], r["context"])
            out[key] = min(out.get(key, float("inf")), r["time_us"])
    return out


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Linear through the sorted points, clamped to the line of the nearest two at the ends."""
    pts = sorted(points)
    if len(pts) == 1:
        return pts[0][1]
    i = next((k for k in range(1, len(pts)) if pts[k][0] >= x), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def op_us(times: dict[tuple[str, int, int], float], op: str, tokens: int,
          context: int) -> float:
    """The op's time at `tokens` rows and `context` (interpolated over the grid)."""
    grid: dict[int, list[tuple[float, float]]] = {}
    for (o, t, c), us in times.items():
        if o == op:
            grid.setdefault(c, []).append((t, us))
    if not grid:
        raise SystemExit(f"error: the profile has no {op} rows")
    by_context = [(c, _interp(pts, tokens)) for c, pts in grid.items()]
    if op != "attn_decode":  # prompt chunks: the grid's nearest context
        return min(by_context, key=lambda cu: abs(cu[0] - context))[1]
    return _interp(by_context, context)


def nccl_us(record: Path, nbytes: int) -> float:
    """NCCL's all-reduce alone at `nbytes`, from a ce_allreduce.py record's NCCL rows."""
    rows = [r for r in json.loads(record.read_text())["alone"] if r["impl"] == "nccl"]
    return _interp([(r["T"] * NCCL_HIDDEN * 2, r["us"]) for r in rows], nbytes)


def layer(t1: dict, t2: dict, tokens: int, decode: int, context: int,
          ar_us: float) -> list[dict[str, Any]]:
    prompt = tokens - decode
    plan = [(op, tokens, 0) for op in TOKEN_OPS]
    plan += [("attn_decode", decode, context), ("attn_prefill", prompt, prompt)]
    rows = []
    for op, n, ctx in plan:
        a, b = op_us(t1, op, n, ctx), op_us(t2, op, n, ctx)
        rows.append({"op": op, "tokens": n, "context": ctx, "tp1_us": a, "tp2_us": b,
                     "per_gpu_ratio": 2 * b / a})
    rows.append({"op": "ar_attn + ar_ffn (NCCL)", "tokens": tokens, "context": 0,
                 "tp1_us": 0.0, "tp2_us": 2 * ar_us, "per_gpu_ratio": None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp1", type=Path, required=True, help="tp = 1 profile")
    ap.add_argument("--tp2", type=Path, required=True, help="tp = 2 profile or .partial.json")
    ap.add_argument("--nccl", type=Path, required=True,
                    help="bench/kernels/ce_allreduce.py --world 2 record")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=340)
    ap.add_argument("--context", type=int, default=1280)
    args = ap.parse_args()
    t1, t2 = best_times(kernel_rows(args.tp1)), best_times(kernel_rows(args.tp2))
    ar = nccl_us(args.nccl, args.tokens * HIDDEN * 2)
    rows = layer(t1, t2, args.tokens, args.decode, args.context, ar)
    tp1 = sum(r["tp1_us"] for r in rows)
    tp2 = sum(r["tp2_us"] for r in rows)
    summary = {"tp1_layer_us": tp1, "tp2_layer_us": tp2,
               "per_gpu_efficiency": tp1 / (2 * tp2),
               "per_gpu_efficiency_without_all_reduce": tp1 / (2 * (tp2 - 2 * ar)),
               "all_reduce_share_of_tp2_layer": 2 * ar / tp2}
    print(f"{'op':26} {'tokens':>6} {'ctx':>5} {'tp1 us':>8} {'tp2 us':>8} {'2 x tp2 / tp1':>13}")
    for r in rows:
        ratio = f"{r['per_gpu_ratio']:13.2f}" if r["per_gpu_ratio"] else ""
        print(f"{r['op']:26} {r['tokens']:6} {r['context']:5} {r['tp1_us']:8.1f} "
              f"{r['tp2_us']:8.1f} {ratio}")
    s = summary
    print(f"layer: tp1 {tp1:.0f} us, tp2 {tp2:.0f} us; per-GPU efficiency "
          f"{s['per_gpu_efficiency']:.2f} ({s['per_gpu_efficiency_without_all_reduce']:.2f} "
          f"without the all-reduces, which are {s['all_reduce_share_of_tp2_layer']:.0%} "
          f"of the tp = 2 layer)")
    stamp = time.strftime("%Y%m%d")
    out = ROOT / "bench" / "results" / f"tp-op-cost-llama3-8b-{stamp}.json"
    out.write_text(json.dumps({
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "command": "bench/analysis/tp_op_cost.py", "ops": rows, **summary}, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
