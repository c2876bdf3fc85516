"""Llama-3-8B from transformers through the frontend vs the project's named-op model, on a GPU.

HF `LlamaForCausalLM` built from Llama-3-8B's config (random bf16 weights, no download), its
attention pointed at the frontend (`use_nanosched`) and partitioned by `llama_rules()`; the
named-op `CausalLM` loaded from the same weights. One run answers issue 37's GPU targets:

- speed: for each model, one dense batch laid out in a CUDA-graph bucket as `nanosched verify`
  lays a key (`bench/_common.key_batch`: decode rows with a cached context, then prompt chunks;
  the same token ids and random KV cache for all), run by Sequential: the bucket's graph
  replayed `--reps` times (ms per forward, CUDA events), the same forward launched op by op
  (wall and CPU launch ms), each op's GPU time in one eager forward (an event pair around every
  launch), the logits of the batch's last rows against the named-op model's. The frontend is
  measured as it comes (sibling linears fused, Inductor on its elementwise ops), without
  Inductor, and with neither (HF's modules as they are), so each lever's share shows;
- initialisation: the default frontend's trace, trace + analysis (`init_s`) and Inductor
  compile seconds, cold (the process's first torch.compile) and again warm; TorchDynamo's
  first start in the process (`dynamo_start_s`, frontend/trace.py's `start_dynamo`: what any
  torch.compile user pays once per process) apart from `init_s`;
- accuracy: four prompts (1,024 tokens) prefilled in one batch by the frontend, the named-op
  model and HF's own eager SDPA forward in bf16, each against HF's eager forward in fp32 on the
  same weights (relative L2 of every position's logits, top-1 agreement where fp32's top-2
  margin exceeds 0.1): bf16 rounding is what HF's bf16 and the named-op model lose; the
  frontend is within rounding when its error is at most `ROUNDING_SLACK` times the larger of
  theirs.

Targets (issue 37): frontend / named-op graph time <= 1.05, init <= 2 s, logits within
rounding. Writes frontend-llama3-8b-<gpu>-<date>-<HHMM>.json to $OUT (else bench/results/).

    PYTHONPATH=. python bench/engine/frontend_llama.py --rows 1024 --decode 256 --context 768
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench._common import ROOT, environment, key_batch

NAMED, FRONTEND, HF16, FP32 = "named_op", "frontend", "hf_bf16", "hf_fp32"
VARIANTS = {  # frontend variants measured beside the default: FrontendModel keywords
    "frontend_no_inductor": {"compile_ops": ()},
    "frontend_unfused": {"compile_ops": (), "fuse": False},  # HF's modules as they are
}
PROMPT_LENS = (200, 517, 64, 243)  # one prefill batch of 1,024 tokens
MARGIN = 0.1  # fp32 top-2 margin (logit units) above which a position is decisive
ROUNDING_SLACK = 1.25


def llama_config(layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                      tie_word_embeddings=False)


def hf_llama(layers: int) -> torch.nn.Module:
    """HF `LlamaForCausalLM` of Llama-3-8B's shapes with `layers` layers on the GPU in bf16:
    norms 1, embeddings N(0, 1), the rest N(0, 1/fan_in), seed 0 (this bench's model and the
    GPU tests' of the frontend and the named-op model)."""
    from transformers import LlamaForCausalLM

    with torch.device("cuda"):
        model = LlamaForCausalLM(llama_config(layers))
    model = model.to(torch.bfloat16).eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 if "embed" in name else 1 / math.sqrt(p.shape[-1]),
                          generator=g)
    return model


def named_model(hf: torch.nn.Module) -> Any:
    from nanosched.models.checkpoint import StateDictSource, load_weights
    from nanosched.models.model import CausalLM
    from nanosched.models.spec import spec_from_hf_config

    spec = spec_from_hf_config(hf.config.to_dict() | {"architectures": ["LlamaForCausalLM"]},
                               name="llama3-8b")
    model = CausalLM(spec, dtype=torch.bfloat16, device="cuda")
    load_weights(model, StateDictSource(hf.state_dict()), where="hf state_dict")
    return model


def frontend_model(hf: torch.nn.Module) -> tuple[Any, dict[str, float]]:
    from nanosched.frontend import FrontendModel
    from nanosched.frontend.hf import llama_rules, use_nanosched

    use_nanosched(hf)
    init = {}
    for when in ("cold", "warm"):
        fm = FrontendModel(hf, llama_rules())
        init |= {f"{when}_trace_s": fm.trace.seconds, f"{when}_init_s": fm.init_seconds,
                 f"{when}_compile_s": fm.compile_seconds,
                 f"{when}_dynamo_start_s": fm.start_seconds}
    return fm, init


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 128256, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_logits(model: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    """HF's own eager forward (SDPA attention) of each prompt: logits [sum of lengths, V]."""
    cfg = model.config
    saved, cfg._attn_implementation = cfg._attn_implementation, "sdpa"
    try:
        with torch.inference_mode():
            return torch.cat([model(torch.tensor([s], device="cuda"), use_cache=False)
                              .logits[0].float() for s in seqs])
    finally:
        cfg._attn_implementation = saved


def fp32_logits(hf: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    """The reference: the same weights in fp32 through HF's eager forward."""
    from transformers import LlamaForCausalLM

    with torch.device("cuda"):
        ref = LlamaForCausalLM(llama_config(hf.config.num_hidden_layers)).eval()
    ref.load_state_dict(hf.state_dict())
    out = hf_logits(ref, seqs)
    del ref
    torch.cuda.empty_cache()
    return out


def batch_logits(model: Any, seqs: list[list[int]]) -> torch.Tensor:
    """The prompts prefilled in one batch by a named-op or frontend model: [T, V]."""
    total = sum(map(len, seqs))
    ws = model.new_workspace(max_tokens=total, num_pages=total // 16 + len(seqs) + 1)
    meta = ws.kv.plan([(r, len(s), False) for r, s in enumerate(seqs)])
    ws.token_ids[:total] = torch.tensor([t for s in seqs for t in s], device=model.device)
    with torch.inference_mode():
        return model.forward(ws, meta, torch.arange(total, device=model.device)).float()


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > MARGIN
    agree = (got.argmax(-1) == ref.argmax(-1))[decisive]
    return {"rel_l2": float(torch.linalg.norm(got - ref) / torch.linalg.norm(ref)),
            "top1_agreement": float(agree.float().mean()), "decisive": int(decisive.sum())}


def accuracy(logits: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Each bf16 model against fp32, the two projects' models against HF's bf16 (module
    docstring), and whether the frontend is within bf16 rounding."""
    ref = logits.pop(FP32)
    out: dict[str, Any] = {f"{k}_vs_fp32": compare(v, ref) for k, v in logits.items()}
    for k in (NAMED, FRONTEND):
        out[f"{k}_vs_{HF16}"] = compare(logits[k], logits[HF16])
    floor = max(out[f"{HF16}_vs_fp32"]["rel_l2"], out[f"{NAMED}_vs_fp32"]["rel_l2"])
    out["within_rounding"] = out[f"{FRONTEND}_vs_fp32"]["rel_l2"] <= ROUNDING_SLACK * floor
    return out


def measure(model: Any, args: argparse.Namespace, ids: torch.Tensor) -> dict[str, Any]:
    """Graph, eager and per-op times of Sequential on one bucketed dense batch."""
    from nanosched.runtime.device import TimedCudaDevice
    from nanosched.runtime.opsched import run_program
    from nanosched.runtime.strategies import Sequential

    kb = key_batch(model, args.rows, args.decode, args.context, args.prompt, capture=True)
    runner, entry = kb.runner, kb.entry
    kb.ws.token_ids[: args.rows] = ids
    with torch.inference_mode():
        t0 = time.perf_counter()
        runner.run(entry, kb.seqs)  # eager over the bucket (compiles), then the capture
        first_run_s = time.perf_counter() - t0
        if runner.errors:
            raise RuntimeError(f"capture failed: {runner.errors}")
        runner.run(entry, kb.seqs)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(args.reps):
            entry.graph.replay()
        b.record()
        b.synchronize()
        graph_ms = a.elapsed_time(b) / args.reps
        rows = torch.arange(args.rows - 8, args.rows, device="cuda")
        logits = model.logits(kb.ws, rows).float()
        wall, cpu = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run_program(entry.program, Sequential(), runner.backend)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((t1 - t0) * 1e3)
        timed = TimedCudaDevice()
        from nanosched.runtime.backend import Backend

        run_program(entry.program, Sequential(), Backend(timed))
        per_op: dict[str, float] = {}
        for span in timed.spans():
            op = span.label.split("[")[0].split(".")[-1]
            per_op[op] = per_op.get(op, 0.0) + span.end_ms - span.start_ms
    return {"graph_ms": graph_ms, "first_run_s": first_run_s,
            "eager_wall_ms": statistics.median(wall),
            "eager_cpu_ms": statistics.median(cpu), "per_op_gpu_ms": per_op,
            "decode_context": kb.context, "logits": logits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", type=int, default=1024, help="dense batch (bucket rows)")
    ap.add_argument("--decode", type=int, default=256, help="decode rows")
    ap.add_argument("--context", type=int, default=768, help="cached tokens per decode row")
    ap.add_argument("--prompt", type=int, default=1024, help="longest prompt chunk")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed")
    args = ap.parse_args()
    env = environment()
    import transformers

    from nanosched.frontend import FrontendModel
    from nanosched.frontend.hf import llama_rules

    env["transformers"] = transformers.__version__
    hf = hf_llama(args.layers)
    ids = torch.randint(0, 128256, (args.rows,), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    seqs = prompts()
    logits = {FP32: fp32_logits(hf, seqs), HF16: hf_logits(hf, seqs)}
    named = named_model(hf)
    results = {NAMED: measure(named, args, ids)}
    logits[NAMED] = batch_logits(named, seqs)
    del named
    torch.cuda.empty_cache()
    fm, init = frontend_model(hf)
    results[FRONTEND] = measure(fm, args, ids)
    logits[FRONTEND] = batch_logits(fm, seqs)
    partition = fm.describe()
    del fm
    for key, kw in VARIANTS.items():
        torch.cuda.empty_cache()
        results[key] = measure(FrontendModel(hf, llama_rules(), **kw), args, ids)
    ref = results[NAMED].pop("logits")
    dense_l2 = {k: float(torch.linalg.norm(r.pop("logits") - ref) / torch.linalg.norm(ref))
                for k, r in results.items() if k != NAMED}
    acc = accuracy(logits)
    ratios = {k: results[k]["graph_ms"] / results[NAMED]["graph_ms"] for k in dense_l2}
    record = {"env": env, "args": vars(args), "init": init, "partition": partition,
              "results": results, "over_named_graph": ratios,
              "dense_batch_logits_rel_l2_vs_named": dense_l2, "accuracy": acc,
              "targets": {"graph_ratio_le_1.05": ratios[FRONTEND] <= 1.05,
                          "cold_init_le_2s": init["cold_init_s"] <= 2.0,
                          "warm_init_le_2s": init["warm_init_s"] <= 2.0,
                          "logits_within_rounding": acc["within_rounding"]}}
    stamp = env["date"][:16].replace("-", "").replace(":", "").replace("T", "-")
    name = f"frontend-llama3-8b-{env['device'].replace(' ', '_')}-{stamp}.json"
    out = Path(os.environ.get("OUT", ROOT / "bench" / "results")) / name
    out.write_text(json.dumps(record, indent=1, default=str))
    report(record, out)


def report(record: dict[str, Any], out: Path) -> None:
    results, init, acc = record["results"], record["init"], record["accuracy"]
    for key, r in results.items():
        ratio = record["over_named_graph"].get(key, 1.0)
        print(f"{key:21s} graph {r['graph_ms']:7.2f} ms ({ratio:.3f})  eager "
              f"{r['eager_wall_ms']:7.2f} ms (CPU {r['eager_cpu_ms']:.2f} ms)")
    print("per op, GPU ms of one eager forward:  " + "  ".join(results))
    for op in results[NAMED]["per_op_gpu_ms"] | results[FRONTEND]["per_op_gpu_ms"]:
        print(f"  {op:14s} " + "  ".join(f"{r['per_op_gpu_ms'].get(op, 0.0):8.3f}"
                                         for r in results.values()))
    print(f"init: cold {init['cold_init_s']:.2f} s (trace {init['cold_trace_s']:.2f}, compile "
          f"{init['cold_compile_s']:.2f}; Dynamo's first start {init['cold_dynamo_start_s']:.2f} "
          f"apart), warm {init['warm_init_s']:.2f} s (trace {init['warm_trace_s']:.2f}, "
          f"compile {init['warm_compile_s']:.2f})")
    for key in (f"{HF16}_vs_fp32", f"{NAMED}_vs_fp32", f"{FRONTEND}_vs_fp32",
                f"{NAMED}_vs_{HF16}", f"{FRONTEND}_vs_{HF16}"):
        print(f"logits {key:22s} rel L2 {acc[key]['rel_l2']:.4f}, top-1 "
              f"{acc[key]['top1_agreement']:.4f} of {acc[key]['decisive']}")
    print(f"targets {record['targets']} -> {out}")


if __name__ == "__main__":
    main()
