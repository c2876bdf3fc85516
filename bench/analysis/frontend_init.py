"""CPU: the frontend's initialisation (trace, then partition and subgraphs) on HF Llama.

Each run is a fresh Python process that builds HF `LlamaForCausalLM`, starts TorchDynamo
(`start_s`: frontend/trace.py's `start_dynamo`, what the process's first `torch.compile` pays,
which `FrontendModel` times apart from its init) and then builds the frontend twice: cold (the
model's code traced for the first time in the process) and warm. Two shapes: the tests' tiny
Llama (fp32 on the CPU, 2 layers) and Llama-3-8B's config on the meta device (bf16, 32 layers,
no memory: the trace needs shapes only). For each: the trace seconds (TorchDynamo's capture of
3 layers), `init_s` (trace + analysis: partition, fusion, subgraphs, buffers), their
difference (the frontend's own analysis), and the process's CPU seconds of the start and of
each init (`*_cpu_s`: the machine is shared, and CPU time varies less with its load than wall
time, which each run records beside `load_1m`); no Inductor compile on the CPU.

    PYTHONPATH=. python bench/analysis/frontend_init.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ("tiny", "llama3-8b-meta")


def one_run(shape: str) -> dict[str, float]:
    """Build the model and the frontend twice in this process (module docstring)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nanosched.frontend import FrontendModel
    from nanosched.frontend.hf import llama_rules, use_nanosched
    from nanosched.frontend.trace import start_dynamo

    if shape == "tiny":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                          max_position_embeddings=256)
        model = LlamaForCausalLM(cfg).eval()
    else:
        from bench.engine.frontend_llama import llama_config

        cfg = llama_config(32)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    use_nanosched(model)
    param = next(model.parameters())
    cpu = time.process_time()
    out = {"start_s": start_dynamo(param.device, param.dtype),
           "start_cpu_s": time.process_time() - cpu}
    for when in ("cold", "warm"):
        cpu = time.process_time()
        fm = FrontendModel(model, llama_rules())
        assert fm.start_seconds == 0.0  # started above
        out |= {f"{when}_trace_s": fm.trace.seconds, f"{when}_init_s": fm.init_seconds,
                f"{when}_analysis_s": fm.init_seconds - fm.trace.seconds,
                f"{when}_init_cpu_s": time.process_time() - cpu}
    return out | {"load_1m": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="fresh processes per shape")
    ap.add_argument("--one", choices=SHAPES, help=argparse.SUPPRESS)  # a child run
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one)))
        return
    record: dict[str, dict[str, object]] = {}
    for shape in SHAPES:
        runs = []
        for _ in range(args.reps):
            done = subprocess.run([sys.executable, __file__, "--one", shape], check=True,
                                  capture_output=True, text=True, cwd=ROOT)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        median = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
        record[shape] = {"median": median, "runs": runs}
        print(f"{shape:15s} " + "  ".join(f"{k} {v:.2f}" for k, v in median.items()))
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    out = ROOT / "bench" / "results" / f"frontend-init-cpu-{stamp}.json"
    import torch
    import transformers

    env = {"python": sys.version.split()[0], "torch": torch.__version__,
           "transformers": transformers.__version__, "cpus": os.cpu_count()}
    out.write_text(json.dumps({"reps": args.reps, "env": env, "shapes": record}, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
