"""The profiler's registry measures the runtime's kernels: its names are the kernels vocabulary,
every implementation runs on CPU tensors at a tiny model's shapes (Triton under
TRITON_INTERPRET=1, fp32) and computes what its torch twin computes."""

import os

import pytest
import torch

from nanosched.errors import ConfigError
from nanosched.kernels import impls as kernel_impls
from nanosched.models.ops import layer_ops
from nanosched.models.spec import ModelSpec
from nanosched.profiler import impl_registry
from nanosched.profiler.backend import Unsupported
from nanosched.runtime.program import LaunchConfig

TINY = ModelSpec("tiny", "llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, intermediate_size=96, vocab_size=100)
TINY_MOE = ModelSpec("tiny-moe", "mixtral", hidden_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=100,
                     num_experts=4, num_experts_per_tok=2)
needs_interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                     reason="needs TRITON_INTERPRET=1 (tests/conftest.py)")


def call(spec: ModelSpec, op: str, ws: impl_registry.ScratchSpace, mechanism: str = "full",
         sms: int = 3) -> impl_registry.OpCall:
    return impl_registry.OpCall(spec, 1, op, 24, 40, sms, mechanism, 8, ws, max_tokens=32)


def test_every_registered_name_is_a_runtime_name():
    one_gpu = {op for op, f in kernel_impls.OP_FAMILY.items() if f != kernel_impls.NETWORK}
    table, _ = impl_registry.available(sorted(one_gpu))  # collectives: profiler/network.py
    assert set(table) == one_gpu
    for op, infos in table.items():
        for info in infos:
            assert kernel_impls.check_op_impl(op, info.name) == info.name
            assert LaunchConfig(impl={op: info.name}).launch_dict(op)["impl"] == info.name
    assert {i.name for i in table["attn_decode"]} == {"triton_pipelined", "triton_pipelined_2w",
                                                  "triton_paged", "torch"}
    with pytest.raises(ConfigError, match=r"'triton_decode' is unknown for op 'attn_decode'"):
        impl_registry.register("attn_decode", impl_registry.Impl("triton_decode", ("full",),
                                                                 lambda c, k: None))


def test_rows_get_the_runtime_launch_dict():
    ws = impl_registry.ScratchSpace(torch.device("cpu"), torch.float32)
    launch = impl_registry.launch_of(call(TINY, "attn_decode", ws, "cta_bound", 16),
                                     "triton_paged")
    assert launch == {"impl": "triton_paged", "max_ctas": 16}
    assert impl_registry.launch_of(call(TINY, "ug", ws, "green_ctx", 100), "cublaslt") == \
        {"impl": "cublaslt", "num_sms": 100, "partition": True}
    assert impl_registry.launch_of(call(TINY, "ug", ws, "full", 132), "cublas") == \
        {"impl": "cublas", "num_sms": 132}


@pytest.mark.slow
@needs_interpret
@pytest.mark.parametrize("spec", [TINY, TINY_MOE])
def test_every_impl_runs_and_matches_its_torch_twin(spec):
    ws = impl_registry.ScratchSpace(torch.device("cpu"), torch.float32)
    table, _ = impl_registry.available([op.name for op in layer_ops(spec, 1)])
    for op in layer_ops(spec, 1):
        names = [i.name for i in table[op.name]]
        outputs = {}
        for name in names:
            impl_registry.get(op.name, name).kernel(call(spec, op.name, ws))  # fill the workspace
            torch.manual_seed(0)  # same block tables, positions and slots for every impl
            impl_registry.get(op.name, name).kernel(call(spec, op.name, ws)).fn()
            outputs[name] = {k: v.clone() for k, v in ws.cache.items() if k.startswith("y_")
                             or k == "q_rope"}
        first = outputs[names[0]]
        assert first, op.name
        for name in names[1:]:
            for key, want in first.items():
                torch.testing.assert_close(outputs[name][key], want, rtol=1e-4, atol=1e-4,
                                           msg=f"{op.name}/{name} {key}")


@needs_interpret
def test_gemm_rows_compute_linear_at_their_sm_count():
    ws = impl_registry.ScratchSpace(torch.device("cpu"), torch.float32)
    for name in ("cublas", "triton_persistent_128x128"):
        impl_registry.get("ug", name).kernel(call(TINY, "ug", ws, "green_ctx", 1)).fn()
        x, w = ws.cache["x_ug"][:24], ws.cache["w_ug"]
        torch.testing.assert_close(ws.cache["y_ug"][:24], x @ w.T, rtol=1e-5, atol=1e-5)
    assert ws.tensor("w_ug", (192, 64)) is w


def test_workspace_refuses_tensors_larger_than_free_memory():
    small = impl_registry.ScratchSpace(torch.device("cpu"), torch.float32, max_bytes=1000)
    with pytest.raises(Unsupported, match=r"decode_k_pages \[96, 16, 2, 16\] needs"):
        impl_registry.get("attn_decode", "triton_paged").kernel(call(TINY, "attn_decode", small))
    with pytest.raises(Unsupported, match=r"attn_decode/torch at 24 x 40 gathers"):
        impl_registry.get("attn_decode", "torch").kernel(call(TINY, "attn_decode", small))
