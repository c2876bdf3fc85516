"""Unmodified HF transformers models through the frontend equal their own eager forward.

Llama, Qwen2 (one KV head), Mixtral (top-2 of 4 experts) with `llama_rules()` and GPT-2 with
the rules of docs/usage.md: three prompts prefilled in one batch (one chunked over two batches,
its second chunk beside decode tokens), then greedy decode steps, under Sequential and the
two-batch overlap; every token's logits match HF's run of each whole sequence (fp32, 1e-5
relative) and the greedy tokens follow. Each 2-layer model is traced once per test process
(`shared_frontend`: 1.5-3 s of CPU a trace).
"""

from __future__ import annotations

import pytest
import torch
from frontend_helpers import (
    PROMPTS,
    hf_frontend,
    max_error_vs_hf,
    run_mixed,
    shared_frontend,
    usage_rules,
)

from nanosched.frontend import FrontendModel
from nanosched.frontend.codegen import linear_out
from nanosched.frontend.hf import llama_rules
from nanosched.frontend.inductor import elementwise_ops
from nanosched.frontend.trace import start_dynamo
from nanosched.runtime.strategies import Sequential, TwoBatchOverlap


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral", "gpt2"])
def test_prefill_and_decode_equal_the_unmodified_model(arch):
    model, fm = shared_frontend(arch)
    ops = [op for op, _ in fm.layer_ops()]
    ffn = ["experts_ug", "act", "experts_d"] if arch == "mixtral" else ["ug", "act", "d"]
    assert ops == ["kqv", "rope_append", "attn_decode", "attn_prefill", "o", "add_norm_ffn",
                   *ffn, "add_norm_attn"]
    for strategy in (Sequential(), TwoBatchOverlap(tile_m=4)):
        seqs, logits = run_mixed(fm, strategy)
        assert max_error_vs_hf(model, seqs, logits) < 1e-5, strategy.name
        for r, seq in seqs.items():  # each generated token: the argmax of the row before it
            prompt = len(PROMPTS[r])
            assert seq[prompt:] == [int(x.argmax()) for x in logits[r][prompt - 1:]]


def test_gpt2_rules_of_the_usage_page_are_at_most_20_lines():
    _, block = usage_rules()
    assert len([line for line in block.splitlines() if line.strip()]) <= 20


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_deep_model_runs_its_traced_middle_layer_for_every_middle_layer(arch):
    """Five layers, three traced: layers 1-3 run the traced layer 1 bound to their own
    weights and KV layers; the buffers are those of the 2-layer trace (one layer's worth)."""
    model, fm = hf_frontend(arch, layers=5, trace_layers=3)
    assert fm.num_layers == 5 and fm.trace.layers == 3
    assert [s.layer for s in fm.steps if s.sub.group.op == "kqv"] == [0, 1, 2, 3, 4]
    seqs, logits = run_mixed(fm, Sequential(), decode_steps=2)
    assert max_error_vs_hf(model, seqs, logits) < 1e-5


def test_dynamos_first_start_is_timed_apart_from_the_trace_and_paid_once():
    """TorchDynamo's first start on a device (`start_dynamo`: a small model of torch's modules
    traced by the capturing backend) runs once per process and device; a frontend built after
    it reports no start, and its init (trace + analysis) covers the trace."""
    meta = torch.device("meta")
    assert start_dynamo(meta, torch.float16) > 0  # no other test starts Dynamo on meta fp16
    assert start_dynamo(meta, torch.float16) == 0.0
    model, fm = shared_frontend("llama")
    again = FrontendModel(model, llama_rules())
    assert again.start_seconds == 0.0 and again.describe()["dynamo_start_s"] == 0.0
    assert fm.init_seconds >= fm.trace.seconds > 0 and again.init_seconds >= again.trace.seconds


def test_llama_writes_every_tensor_in_place_and_keeps_one_layer_of_buffers():
    """No copy inside a layer (only the embedding's output is copied into its buffer), and
    buffers shared across layers: as many for 4 layers as for 2."""
    _, two = shared_frontend("llama")
    desc = two.describe()
    assert desc["copies"] == ["embed:inputs_embeds"]
    assert desc["writes"]["alloc"] == 2  # each layer's attention output
    _, four = hf_frontend("llama", layers=4, trace_layers=None)
    assert four.describe()["buffers"] == desc["buffers"]
    assert four.describe()["buffer_bytes_per_token"] == desc["buffer_bytes_per_token"]


def gemms_per_op(fm: FrontendModel, layer: int = 1) -> dict[str, int]:
    """GEMM calls (the frontend's `linear` through the project's dispatch) per op of a layer."""
    return {s.sub.group.op: sum(n.target is linear_out for n in s.sub.module.graph.nodes)
            for s in fm.steps if s.layer == layer}


def fused_kqv(fm: FrontendModel) -> list[torch.Tensor]:
    """The tensors layer 1's kqv op is bound to (its weight and bias)."""
    step = next(s for s in fm.steps if s.layer == 1 and s.sub.group.op == "kqv")
    return [t for t in step.bound if isinstance(t, torch.Tensor)]


def test_sibling_linears_run_as_one_gemm_on_weights_held_once():
    """Qwen2's q/k/v (with biases) and gate/up: one GEMM each on concatenated weights, which
    the model's parameters then view (held once); without fusion three and two GEMMs. A second
    frontend on the same model views the same concatenation, and the model still runs."""
    model, fm = shared_frontend("qwen2")
    want = {"kqv": 1, "o": 1, "ug": 1, "d": 1}
    assert {op: n for op, n in gemms_per_op(fm).items() if n} == want
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    weight, bias = fused_kqv(fm)
    assert weight.shape[0] == attn.q_proj.out_features + 2 * attn.k_proj.out_features
    assert attn.q_proj.weight.data_ptr() == weight.data_ptr()
    assert attn.v_proj.bias.data_ptr() == bias[-attn.v_proj.out_features:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == \
        mlp.gate_proj.weight.data_ptr() + mlp.gate_proj.weight.nbytes
    again = FrontendModel(model, llama_rules())
    assert fused_kqv(again)[0].data_ptr() == weight.data_ptr()
    unfused = FrontendModel(model, llama_rules(), fuse=False)
    assert {op: n for op, n in gemms_per_op(unfused).items() if n} == {**want, "kqv": 3, "ug": 2}
    seqs, logits = run_mixed(again, Sequential(), decode_steps=1)
    assert max_error_vs_hf(model, seqs, logits) < 1e-5


@pytest.mark.slow
def test_ops_compiled_by_inductor_keep_the_model_exact():
    """The ops a GPU compiles by default (norms, rotary + KV append, activation: every op
    that calls no GEMM or attention) compiled by TorchInductor at initialisation (sizes
    dynamic, results written into the buffers; five layers, the middle three running one
    compiled traced layer on their own weights) still give HF's logits under both strategies,
    with no compile left for the forwards (a C++ compiler: about a minute)."""
    _, plain = shared_frontend("llama")  # the default on the CPU: nothing compiled
    assert plain.compiled_ops == () and plain.compile_seconds == 0
    chosen = elementwise_ops([s.sub for s in plain.steps])
    assert chosen == ("rope_append", "add_norm_ffn", "act", "add_norm_attn")
    model, fm = hf_frontend("llama", layers=5, compile_ops=chosen)  # layers 1-3 share layer 1's
    assert fm.compile_seconds > 0 and fm.describe()["compiled_ops"] == list(chosen)
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    for strategy in (Sequential(), TwoBatchOverlap(tile_m=4)):
        seqs, logits = run_mixed(fm, strategy)
        assert max_error_vs_hf(model, seqs, logits) < 1e-5, strategy.name
    ws = fm.new_workspace(max_tokens=8, num_pages=4)
    fm.forward(ws, ws.kv.plan([(0, 6, False)]))  # grad mode on, as the profiler calls ops
    assert counters["stats"]["unique_graphs"] == before  # compiled at init, none since
