"""Where the CPU time of launching one forward goes (cProfile), starting with the GPU idle.

    PYTHONPATH=. python bench/engine/profile_launch.py [--tokens 2048] [--layers 32]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from bench.engine.overhead import batch
from nanosched.models.spec import REGISTRY
from nanosched.runtime.backend import Backend
from nanosched.runtime.device import CudaDevice
from nanosched.runtime.loader import load_model
from nanosched.runtime.modelprogram import model_program
from nanosched.runtime.opsched import run_program
from nanosched.runtime.strategies import Sequential


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    spec = REGISTRY["llama3-8b"]
    spec = spec.__class__(**{**spec.to_json(), "num_layers": args.layers})
    model = load_model(spec, "random", torch.device("cuda"))
    ws = model.new_workspace(args.tokens, num_pages=60_000)
    with torch.inference_mode():
        for rep in range(3):
            meta, segments, ids, _ = batch(ws, args.tokens, first_id=rep * 1_000_000)
            program = model_program(model, ws, meta, segments)
            torch.cuda.synchronize()  # GPU idle at the start: queued work never blocks the CPU
            prof = cProfile.Profile() if rep == 2 else None
            t = time.perf_counter()
            if prof:
                prof.enable()
            run_program(program, Sequential(), Backend(CudaDevice()))
            if prof:
                prof.disable()
            print(f"launch {1e3 * (time.perf_counter() - t):.1f} ms")
            torch.cuda.synchronize()
            for r in ids:
                ws.kv.release(r)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof).sort_stats("cumtime").print_stats(25)


if __name__ == "__main__":
    main()
