"""What every benchmark harness shares: the environment record, the measured GEMM peak, and
synthetic full batches planned into a workspace (decode tokens with a given cached context,
then prompt chunks), so that a forward can be timed on a batch shaped like a schedule's."""

from __future__ import annotations

import datetime
import platform
import sys
from typing import Any

import torch


def measured_gemm_tflops(device: torch.device, precision: str = "bf16") -> float | None:
    """GEMM peak at 8192^3 on `device` in `precision` (bf16, or fp8 for FP8 weights), measured
    as the profiler measures its ceiling (`profiler.timing.gemm_peak_tflops`); None on the
    CPU."""
    if device.type != "cuda":
        return None
    from nanosched.profiler.timing import gemm_peak_tflops

    return gemm_peak_tflops(device, precision)


def environment(device: torch.device) -> dict[str, Any]:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__,
           "command": " ".join(sys.argv)}
    if device.type == "cuda":
        import triton

        env |= {"device": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                "triton": triton.__version__,
                "num_sms": torch.cuda.get_device_properties(device).multi_processor_count}
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return env


def cache_context(ws: Any, num_decode: int, context: int, first_id: int) -> None:
    """Give `num_decode` requests (ids from `first_id`) `context - 1` cached tokens each."""
    for r in range(num_decode if context > 1 else 0):
        ws.kv.plan([(first_id + r, context - 1, False)])


def synthetic_batch(ws: Any, dense: int, num_decode: int, context: int, prompt: int,
                    first_id: int) -> tuple[Any, list[tuple[int, int, bool]], list[int]]:
    """Plan a full batch into `ws`: `num_decode` decode tokens with `context` cached tokens
    each, then prompt chunks of at most `prompt` tokens. Returns (meta, segments, request ids)."""
    cache_context(ws, num_decode, context, first_id)
    return plan_batch(ws, dense, num_decode, prompt, first_id)


def batch_chunks(dense: int, num_decode: int, prompt: int, first_id: int,
                 decode_rows: int | None = None) -> list[tuple[int, int, bool]]:
    """`num_decode` decode tokens, then prompt chunks of at most `prompt` tokens filling the
    batch to `dense` rows; with `decode_rows` the decode tokens take that many rows (a graph
    bucket's padding)."""
    chunks = [(first_id + r, 1, True) for r in range(num_decode)]
    left, p = dense - (num_decode if decode_rows is None else decode_rows), 0
    while left > 0:
        n = min(prompt, left)
        chunks.append((first_id + 10**6 + p, n, False))
        left, p = left - n, p + 1
    return chunks


def decode_room(ws: Any, dense: int, num_decode: int, prompt: int) -> int:
    """Free KV pages left for the decode rows of a synthetic batch once its prompt chunks have
    theirs (the accounting of `throughput.forward_pages`: whole pages, one more per chunk for a
    partial page, 8 spare)."""
    rest = dense - num_decode
    return ws.kv.allocator.num_free - -(-rest // ws.kv.page_size) - -(-rest // max(1, prompt)) - 8


def synthetic_decode_context(ws: Any, dense: int, num_decode: int, context: int, prompt: int
                             ) -> int:
    """The decode context of a synthetic batch: `context`, or less where `num_decode` requests
    of it do not fit in the cache beside the prompt chunks (many decode rows at a long context
    exceed the GPU's memory; the engine never forms such a batch)."""
    if num_decode == 0:
        return context
    room = decode_room(ws, dense, num_decode, prompt)
    return max(1, min(context, room // num_decode * ws.kv.page_size - 1))


def bucket_batch(ws: Any, dense: int, num_decode: int, context: int, prompt: int,
                 first_id: int, align: int) -> tuple[list[Any], list[int]]:
    """A synthetic batch for a CUDA-graph bucket: `num_decode` decode tokens (each with
    `context` cached tokens) on decode rows rounded up to `align`, then prompt chunks of at
    most `prompt` tokens filling `dense` rows, planned into `ws`. Returns (its SeqChunks, its
    request ids, for `ws.kv.release`)."""
    from nanosched.models.bucket import round_up

    cache_context(ws, num_decode, context, first_id)
    chunks = batch_chunks(dense, num_decode, prompt, first_id,
                          decode_rows=round_up(num_decode, align))
    return ws.kv.plan_chunks(chunks), [c[0] for c in chunks]


def plan_batch(ws: Any, dense: int, num_decode: int, prompt: int,
               first_id: int) -> tuple[Any, list[tuple[int, int, bool]], list[int]]:
    """Plan the batch itself (decode requests already cached by `cache_context`)."""
    chunks = batch_chunks(dense, num_decode, prompt, first_id)
    meta = ws.kv.plan(chunks)
    segments, row = [], 0
    for _, n, is_decode in chunks:
        segments.append((row, row + n, is_decode))
        row += n
    ws.token_ids[:dense].random_(0, 1000)
    return meta, segments, [c[0] for c in chunks]


