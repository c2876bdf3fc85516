"""Ops on nano-batches (token ranges) give the same result as the sequential forward.

The batch mixes decode tokens and prefill chunks; the ranges cut a prompt, so the second
range's prefill attention reads the first range's K/V from the paged cache.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import make_hf

from nanosched.errors import ConfigError
from nanosched.models.checkpoint import load_checkpoint
from nanosched.models.model import CausalLM
from nanosched.models.spec import load_spec

RANGES = [(0, 3), (3, 10), (10, 21)]  # 2 decode tokens, then prompts of 12 and 7 tokens


def prepared(model):
    """A workspace whose cache holds two 5-token prompts, and the next mixed batch."""
    ws = model.new_workspace(max_tokens=32, num_pages=12)
    meta = ws.kv.plan([(0, 5, False), (1, 5, False)])
    ws.token_ids[:10] = torch.arange(10) + 1
    with torch.inference_mode():
        model(ws, meta)
    meta = ws.kv.plan([(0, 1, True), (1, 1, True), (2, 12, False), (3, 7, False)])
    ws.token_ids[:21] = torch.tensor([9, 4] + list(range(30, 42)) + list(range(50, 57)))
    return ws, meta


def run_nano(model, ws, meta, op_major: bool):
    with torch.inference_mode():
        for s, e in RANGES:
            model.embed(ws, meta, s, e)
        for layer in range(model.spec.num_layers):
            if op_major:  # each op over every range, then the next op
                for name in model.op_names():
                    for s, e in RANGES:
                        model.run_op(layer, name, ws, meta, s, e)
            else:  # every op of a range, then the next range
                for s, e in RANGES:
                    for name in model.op_names():
                        model.run_op(layer, name, ws, meta, s, e)
        return model.logits(ws, num_tokens=meta.end)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
@pytest.mark.parametrize("op_major", [True, False])
def test_nano_batches_equal_sequential(tmp_path, arch, op_major):
    make_hf(arch, tmp_path, seed=3)
    model = CausalLM(load_spec(str(tmp_path)))
    load_checkpoint(model, tmp_path)
    ws_a, meta_a = prepared(model)
    with torch.inference_mode():
        expected = model(ws_a, meta_a)
    ws_b, meta_b = prepared(model)
    got = run_nano(model, ws_b, meta_b, op_major)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ws_b.kv.k, ws_a.kv.k, rtol=1e-5, atol=1e-5)


def test_run_op_rejects_unknown_op(tmp_path):
    make_hf("llama", tmp_path, num_hidden_layers=1)
    model = CausalLM(load_spec(str(tmp_path)))
    ws = model.new_workspace(4, 2)
    meta = ws.kv.plan([(0, 4, False)])
    for bad in ("experts_ug", "attn_everything"):
        with pytest.raises(ConfigError, match=f"op '{bad}' is not an op of model"):
            model.run_op(0, bad, ws, meta, 0, 4)
    model.run_op(0, "ar_attn", ws, meta, 0, 4)  # network ops are no-ops at tp = 1
    assert model.op_names() == ["kqv", "rope_append", "attn_decode", "attn_prefill", "o",
                                "add_norm_ffn", "ug", "act", "d", "add_norm_attn"]
