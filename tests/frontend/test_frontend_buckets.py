"""A frontend model runs in the engine's CUDA-graph buckets (runtime/graphs.py).

Batches laid out as the engine lays them in a `BucketRunner` (the bucket's static metadata:
padded decode rows, prompt chunks from the bucket's first prefill row, the scratch page) give
the logits of the same batches run on their own metadata. On the CPU the runner runs each
bucket eagerly over its metadata (what a graph captures); tests/gpu/test_frontend_gpu.py
captures and replays the graphs.
"""

from __future__ import annotations

import torch
from frontend_helpers import BUCKET_ROUNDS, bucket_forward, plain_forward, shared_frontend, tiny_hf

from nanosched.frontend import FrontendModel
from nanosched.frontend.hf import llama_rules, use_nanosched
from nanosched.runtime.backend import Backend
from nanosched.runtime.device import SerialDevice
from nanosched.runtime.graphs import BucketRunner
from nanosched.runtime.strategies import Sequential, TwoBatchOverlap


def _rounds_match(fm, runner, ref, ref_ws) -> None:
    """Every round of BUCKET_ROUNDS through `runner`'s buckets equals `ref`'s plain forward."""
    with torch.inference_mode():
        for chunks, ids in BUCKET_ROUNDS:
            want = plain_forward(ref, ref_ws, chunks, ids)
            got = bucket_forward(fm, runner, chunks, ids)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bucketed_batches_equal_plain_ones():
    _, fm = shared_frontend("llama")
    ref_ws = fm.new_workspace(max_tokens=64, num_pages=32, page_size=4)
    ws = fm.new_workspace(max_tokens=64, num_pages=32, page_size=4)
    for strategy in (Sequential(), TwoBatchOverlap(tile_m=8)):
        runner = BucketRunner(fm, ws, Backend(SerialDevice()), strategy, align=8, max_pages=16,
                              capture=False)
        _rounds_match(fm, runner, fm, ref_ws)
        assert runner.stats.eager_bucket == len(BUCKET_ROUNDS)
        for r in range(4):
            ws.kv.release(r)
            ref_ws.kv.release(r)


def test_ops_compiled_at_init_stay_compiled_when_another_frontend_is_built():
    """A frontend's Inductor-compiled op (the activation here, the smallest) is compiled at its
    initialisation for every bucket; building another frontend in the same process (the
    uncompiled reference, as the GPU test does) must not drop those compiles, so the bucketed
    batches of both strategies compile nothing after init and equal the reference's."""
    model = tiny_hf("llama")
    use_nanosched(model)
    fm = FrontendModel(model, llama_rules(), compile_ops=("act",))
    plain = FrontendModel(model, llama_rules(), compile_ops=())
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"]["unique_graphs"]
    for strategy in (Sequential(), TwoBatchOverlap(tile_m=8)):
        ref_ws = plain.new_workspace(max_tokens=64, num_pages=32, page_size=4)
        ws = fm.new_workspace(max_tokens=64, num_pages=32, page_size=4)
        runner = BucketRunner(fm, ws, Backend(SerialDevice()), strategy, align=8, max_pages=16,
                              capture=False)
        _rounds_match(fm, runner, plain, ref_ws)
    assert counters["stats"]["unique_graphs"] == graphs
