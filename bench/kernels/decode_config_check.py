"""Checks every decode-attention `DecodeConfig` of the sweep against the torch reference, each
in its own process (an illegal address poisons a CUDA context), several processes at a time.

    PYTHONPATH=. python bench/kernels/decode_config_check.py [--jobs 8] [--blocks 32,64,128]
        [--stages 1,2,3,4,5]
                                        [--warps 4,8]

Prints one line per configuration (ok / error / wrong), writes the good ones to `--ok-file`
(kernels_decode_attn.py --sweep reads it) and exits non-zero if any is not ok.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHILD = """
import sys, torch
from nanosched.kernels.common import DecodeConfig
from nanosched.kernels.decode_attn import decode_attention
from nanosched.kernels import reference as ref
bn, st, nw = map(int, sys.argv[1:4])
torch.manual_seed(0)
ctx = [1, 15, 16, 17, 4096, 3000, 2048, 8000, 0, 4097, 33, 1000, 1500, 2500, 5000, 700] * 4
pages_per = [(c + 15) // 16 for c in ctx]
num_pages = sum(pages_per) + 4
perm = torch.randperm(num_pages, device="cuda").int()
tables = torch.zeros(len(ctx), max(pages_per), dtype=torch.int32, device="cuda")
at = 0
for i, k in enumerate(pages_per):
    tables[i, :k] = perm[at:at + k]; at += k
kc = torch.randn(num_pages, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
vc = torch.randn_like(kc)
q = torch.randn(len(ctx), 32, 128, device="cuda", dtype=torch.bfloat16)
lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
want = torch.empty(q.shape, device="cuda")
ref.decode_attention(q.float(), kc.float(), vc.float(), tables, lens, max(ctx), 128**-0.5, want)
worst = 0.0
for ctas in (16, 64, 264):
    got = torch.full_like(q, float("nan"))
    decode_attention(q, kc, vc, tables, lens, max(ctx), 128**-0.5, got, max_ctas=ctas,
                     config=DecodeConfig(bn, st, nw, 2))
    torch.cuda.synchronize()
    worst = max(worst, ((got.float() - want).norm() / want.norm()).item())
print("ok" if worst < 2e-2 else "wrong", f"{worst:.1e}")
"""


def run(cfg: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    out = subprocess.run([sys.executable, "-c", CHILD, *map(str, cfg)], capture_output=True,
                         text=True, timeout=300, env={**__import__("os").environ,
                                                      "CUDA_LAUNCH_BLOCKING": "1"})
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return cfg, f"error: {last[:120]}"
    return cfg, out.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--ok-file", default="", help="write the configurations that pass (JSON)")
    ap.add_argument("--blocks", default="32,64,128")
    ap.add_argument("--stages", default="1,2,3,4,5")
    ap.add_argument("--warps", default="4,8")
    args = ap.parse_args()

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    configs = [(bn, st, nw) for bn in ints(args.blocks) for st in ints(args.stages)
               for nw in ints(args.warps)]
    bad, good = 0, []
    with ThreadPoolExecutor(args.jobs) as pool:
        for cfg, res in pool.map(run, configs):
            print(f"block {cfg[0]} stages {cfg[1]} warps {cfg[2]}: {res}", flush=True)
            if res.startswith("ok"):
                good.append(cfg)
            bad += not res.startswith("ok")
    if args.ok_file:
        Path(args.ok_file).write_text(json.dumps(good))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
