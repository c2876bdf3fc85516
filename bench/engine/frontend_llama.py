"""Llama-3-8B from transformers through the frontend vs the project's named-op model, on a GPU.

HF `LlamaForCausalLM` built from Llama-3-8B's config (random bf16 weights, no download), its
attention pointed at the frontend (`use_nanosched`) and partitioned by `llama_rules()`; the
named-op `CausalLM` loaded from the same weights. For each, one dense batch laid out in a
CUDA-graph bucket as `nanosched verify` lays a key (`bench/_common.key_batch`: decode rows with
a cached context, then prompt chunks; the same token ids and random KV cache for both), run by
Sequential:

- graph: the bucket's CUDA graph replayed `--reps` times, ms per forward (CUDA events);
- eager: the same forward launched op by op, wall ms and the CPU's launch ms (the frontend's
  own per-call cost: building row views and calling its FX modules);
- per op: each op's GPU time in one eager forward (a CUDA event pair around every launch);
- logits at the batch's last rows of both (relative L2 error: same weights, same inputs);
- init: the frontend's trace + partition seconds, cold (the process's first torch.compile)
  and again warm;
- the frontend again with TorchInductor compiling its norms and activation (`compile_ops`;
  their compile time is in `first_run_s`).

Targets (issue 37): frontend / named-op graph time ≤ 1.05, init ≤ 2 s. Writes
bench/results/frontend-llama3-8b-<gpu>-<date>.json (or $OUT/...).

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

NAMED, FRONTEND, INDUCTOR = "named_op", "frontend", "frontend_inductor"
COMPILED = ("add_norm_ffn", "act", "add_norm_attn")  # HF's norms and SiLU * up: small kernels


def hf_llama(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                      tie_word_embeddings=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
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
    cold = FrontendModel(hf, llama_rules())
    warm = FrontendModel(hf, llama_rules())
    init = {"cold_init_s": cold.init_seconds, "cold_trace_s": cold.trace.seconds,
            "warm_init_s": warm.init_seconds, "warm_trace_s": warm.trace.seconds}
    return warm, init


def measure(model: Any, args: argparse.Namespace, ids: torch.Tensor) -> dict[str, Any]:
    """Graph, eager and per-op times of Sequential on one bucketed dense batch."""
    from nanosched.runtime.device import TimedCudaDevice
    from nanosched.runtime.scheduler import run_program
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

    env["transformers"] = transformers.__version__
    hf = hf_llama(args.layers)
    ids = torch.randint(0, 128256, (args.rows,), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    named = named_model(hf)
    results = {NAMED: measure(named, args, ids)}
    del named
    torch.cuda.empty_cache()
    fm, init = frontend_model(hf)
    results[FRONTEND] = measure(fm, args, ids)
    partition = fm.describe()
    del fm
    from nanosched.frontend import FrontendModel
    from nanosched.frontend.hf import llama_rules

    results[INDUCTOR] = measure(FrontendModel(hf, llama_rules(), compile_ops=COMPILED), args,
                                ids)
    ref = results[NAMED].pop("logits")
    errors = {k: float(torch.linalg.norm(results[k].pop("logits") - ref) / torch.linalg.norm(ref))
              for k in (FRONTEND, INDUCTOR)}
    ratios = {k: results[k]["graph_ms"] / results[NAMED]["graph_ms"] for k in (FRONTEND, INDUCTOR)}
    ratio = ratios[FRONTEND]
    record = {"env": env, "args": vars(args), "init": init, "partition": partition,
              "compiled_ops": COMPILED,
              "results": results, "over_named_graph": ratios, "logits_rel_l2": errors,
              "targets": {"graph_ratio_le_1.05": {k: r <= 1.05 for k, r in ratios.items()},
                          "init_le_2s": init["cold_init_s"] <= 2.0}}
    name = (f"frontend-llama3-8b-{env['device'].replace(' ', '_')}-"
            f"{env['date'][:10].replace('-', '')}.json")
    out = Path(os.environ.get("OUT", ROOT / "bench" / "results")) / name
    out.write_text(json.dumps(record, indent=1, default=str))
    for key in (NAMED, FRONTEND, INDUCTOR):
        r = results[key]
        print(f"{key:17s} graph {r['graph_ms']:.2f} ms  eager {r['eager_wall_ms']:.2f} ms "
              f"(CPU {r['eager_cpu_ms']:.2f} ms)")
    print(f"over named-op (graphs): frontend {ratio:.3f}, with Inductor "
          f"{ratios[INDUCTOR]:.3f}; logits rel L2 {errors}; init cold "
          f"{init['cold_init_s']:.2f} s, warm {init['warm_init_s']:.2f} s (trace "
          f"{init['warm_trace_s']:.2f} s) -> {out}")


if __name__ == "__main__":
    main()
