"""GPU: a whole model's logits with FP8 weights (W8A8) against the same model in bf16.

    PYTHONPATH=. python bench/engine/fp8_accuracy.py [--model llama3-8b] [--prompts 4]
        [--prompt-len 512] [--seed 0]

Builds the model twice from the same seeded random weights (models/weights.init_random: an
e4m3 weight is the bf16 model's draw quantised per row), runs one prefill batch of
`--prompts` random prompts and one decode step after it, and compares the logits of every
row: relative L2, top-1 agreement, and the mean |cos| between the final normed rows of
different tokens (near 0 for independent rows; a high value says the random weights' hidden
states collapsed, and top-1 agreement then says less). JSON to $OUT or bench/results/.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench._common import environment, write_result
from nanosched.models.model import CausalLM
from nanosched.models.spec import load_spec
from nanosched.models.weights import init_random


def _build(spec, quantization: str, seed: int, device: str) -> CausalLM:
    model = CausalLM(spec, dtype=torch.bfloat16, device=device, quantization=quantization)
    init_random(model, seed=seed)
    return model


def _run(model: CausalLM, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    """Prefill logits [P*L, V], the final normed prefill rows, decode logits [P, V]."""
    num, length = prompts.shape
    pages = num * (length // 16 + 2)
    ws = model.new_workspace(num * length, pages, kv_dtype="auto")
    meta = ws.kv.plan([(i, length, False) for i in range(num)])
    ws.token_ids[:num * length].copy_(prompts.reshape(-1))
    prefill = model.forward(ws, meta).float()
    normed = ws.normed[:num * length].float().clone()
    nxt = prefill.view(num, length, -1)[:, -1].argmax(-1)
    meta = ws.kv.plan([(i, 1, True) for i in range(num)])
    ws.token_ids[:num].copy_(nxt)
    decode = model.forward(ws, meta).float()
    return prefill, normed, decode


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    return {"rel_l2": ((a - b).norm() / b.norm()).item(),
            "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


def _mean_abs_cos(rows: torch.Tensor, sample: int = 512) -> float:
    idx = torch.linspace(0, len(rows) - 1, min(sample, len(rows)), device=rows.device).long()
    x = torch.nn.functional.normalize(rows[idx], dim=-1)
    cos = (x @ x.T).abs()
    n = len(x)
    return ((cos.sum() - cos.diagonal().sum()) / (n * (n - 1))).item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (the exact emulation)")
    args = ap.parse_args(argv)
    spec = load_spec(args.model)
    gen = torch.Generator(device=args.device).manual_seed(args.seed + 1)
    prompts = torch.randint(0, spec.vocab_size, (args.prompts, args.prompt_len), device=args.device,
                            generator=gen)
    results = {}
    with torch.no_grad():
        for q in ("none", "fp8"):
            model = _build(spec, q, args.seed, args.device)
            results[q] = _run(model, prompts)
            del model
            if args.device != "cpu":
                torch.cuda.empty_cache()
    (p8, n8, d8), (pb, nb, db) = results["fp8"], results["none"]
    record = {
        "env": (environment() if args.device != "cpu" else
                {"device": "cpu", "date": datetime.now(timezone.utc).isoformat()}),
        "command": " ".join(sys.argv),
        "model": args.model, "weights": "random", "seed": args.seed,
        "prompts": args.prompts, "prompt_len": args.prompt_len,
        "prefill": _compare(p8, pb), "decode": _compare(d8, db),
        "mean_abs_cos_final_rows": {"bf16": _mean_abs_cos(nb), "fp8": _mean_abs_cos(n8)},
    }
    path = write_result(f"fp8_accuracy-{Path(args.model).name}", record)
    print(f"{args.model} FP8 vs bf16 ({args.prompts} x {args.prompt_len} random prompts): "
          f"prefill rel L2 {record['prefill']['rel_l2']:.4f}, top-1 "
          f"{record['prefill']['top1_agreement']:.4f}; decode rel L2 "
          f"{record['decode']['rel_l2']:.4f}, top-1 {record['decode']['top1_agreement']:.4f}; "
          f"final rows mean |cos| {record['mean_abs_cos_final_rows']['bf16']:.3f} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
