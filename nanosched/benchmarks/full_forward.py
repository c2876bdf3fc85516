"""A benchmark's full-batch forward: one dense batch of synthetic requests, timed.

`forward_ms` plans a full batch (`num_decode` decode rows of a given context, prompt chunks
after) into the workspace of a finished run and times its forward, eagerly or as a CUDA graph's
replay; `forward_pages` is the KV room it needs. At tp > 1 every rank must run the same forward
(its collectives pair up): `engine_forward_ms` is the function `Engine.run_on_ranks` runs on
each rank's engine.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from nanosched.benchmarks.common import (
    bucket_batch,
    decode_room,
    synthetic_batch,
    synthetic_decode_context,
)
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.opsched import OpScheduler


def forward_pages(dense: int, num_decode: int, context: int, prompt: int, page: int) -> int:
    """KV pages `forward_ms` plans its full batch into: `num_decode` requests of `context`
    cached tokens plus their next one, prompt chunks of at most `prompt` tokens, 8 spare."""
    chunks = -(-(dense - num_decode) // max(1, prompt))
    return num_decode * -(-(context + 1) // page) + -(-(dense - num_decode) // page) + chunks + 8


def forward_ms(model: Any, ws: Any, strategy: OpScheduler, device: Any, dense: int,
               num_decode: int, context: int, prompt: int, reps: int = 5, graphs: bool = False
               ) -> tuple[float, int, int]:
    """Median wall time of one forward over a full synthetic batch (synchronised each time),
    in the workspace `ws` of a finished run; decode tokens and their context shrink to what its
    cache holds. With `graphs`, the batch is laid out in its bucket (decode rows rounded up to
    32) and the forward is a CUDA graph's replay, metadata writes included. Returns (ms, decode
    tokens, decode context). At tp > 1 the ranks line up before each timed forward: a rank
    that starts late would count in the others' time, their collectives waiting for it."""
    from nanosched.runtime.backend import Backend
    from nanosched.runtime.graphs import BucketRunner
    from nanosched.runtime.modelprogram import model_program
    from nanosched.runtime.opsched import pick_strategy, run_program
    from nanosched.runtime.strategies import Sequential

    page = ws.kv.page_size
    num_decode = max(0, min(num_decode, decode_room(ws, dense, num_decode, prompt)))
    context = synthetic_decode_context(ws, dense, num_decode, context, prompt)
    runner = BucketRunner(model, ws, Backend(device), strategy, align=EngineConfig.graph_align,
                          max_pages=-(-max(context + 1, prompt) // page), capture=True) \
        if graphs else None
    untimed = 2 if graphs else 1  # the first forward compiles; with graphs the second captures
    tp = getattr(model, "tp", None)
    times = []
    for rep in range(reps + untimed):
        first_id = rep * 10**7
        if runner is None:
            meta, segments, ids = synthetic_batch(ws, dense, num_decode, context, prompt,
                                                  first_id)
            program = model_program(model, ws, meta, segments)
            run, _ = pick_strategy(strategy, Sequential(), program, num_decode)
            _line_up(tp, model.device)
            t0 = time.perf_counter()
            run_program(program, run, Backend(device))
        else:
            seqs, ids = bucket_batch(ws, dense, num_decode, context, prompt, first_id,
                                     runner.align)
            ws.token_ids[:dense].random_(0, 1000)
            entry = runner.entry(runner.bucket(seqs))
            _line_up(tp, model.device)
            t0 = time.perf_counter()
            runner.run(entry, seqs)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        if rep >= untimed:
            times.append((time.perf_counter() - t0) * 1e3)
        for r in ids:
            ws.kv.release(r)
    return float(np.median(times)), num_decode, context


def engine_forward_ms(engine: Any, dense: int, num_decode: int, context: int, prompt: int,
                      graphs: bool) -> tuple[float, int, int]:
    """`forward_ms` in `engine`'s workspace with its strategy and streams (module-level, so
    that a tensor-parallel worker can be told to run it: `Engine.run_on_ranks`)."""
    return forward_ms(engine.model, engine.ws, engine.strategy, engine.backend.device, dense,
                      num_decode, context, prompt, graphs=graphs)


def _line_up(tp: Any, device: torch.device) -> None:
    """Every rank's GPU idle and every rank here before a timed region starts (tp > 1)."""
    if tp is not None and tp.size > 1:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tp.barrier()
