"""Every torch implementation in the registry runs on CPU tensors at a tiny model's shapes,
and the GEMMs compute x @ w.T, so the GPU run starts from setups that are known to work."""

import pytest
import torch

from nanosched.models.ops import layer_ops
from nanosched.models.spec import ModelSpec
from nanosched.profiler import impls
from nanosched.profiler.backend import Unsupported

TINY = ModelSpec("tiny", "llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, intermediate_size=96, vocab_size=100)
TINY_MOE = ModelSpec("tiny-moe", "mixtral", hidden_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=100,
                     num_experts=4, num_experts_per_tok=2)
ON_CPU = {"cublas", "torch_bmm", "torch_sdpa", "torch"}


@pytest.mark.parametrize("spec", [TINY, TINY_MOE])
def test_torch_impls_run_on_cpu(spec):
    ws = impls.Workspace(torch.device("cpu"), torch.float32)
    table, _ = impls.available([op.name for op in layer_ops(spec, 2)])
    for op in layer_ops(spec, 2):
        if op.resource == "network":
            continue
        names = [i.name for i in table[op.name]]
        assert names, op.name
        for name in [n for n in names if n in ON_CPU]:
            call = impls.OpCall(spec, 2, op.name, 24, 40, 8, "full", 8, ws, max_tokens=32)
            impls.get(op.name, name).setup(call).fn()


def test_gemm_computes_linear_and_workspace_reuses_tensors():
    ws = impls.Workspace(torch.device("cpu"), torch.float32)
    call = impls.OpCall(TINY, 1, "ug", 16, 0, 8, "full", 8, ws, max_tokens=32)
    out = impls.get("ug", "cublas").setup(call).fn()
    x, w = ws.cache["x_ug"][:16], ws.cache["w_ug"]
    assert out.shape == (16, 2 * 96) and torch.allclose(out, x @ w.T)
    assert ws.tensor("w_ug", (192, 64)) is w
    small = impls.Workspace(torch.device("cpu"), torch.float32, max_bytes=1000)
    with pytest.raises(Unsupported, match=r"k_cache \[32, 2, 40, 16\] needs"):
        impls.get("attn_decode", "torch_sdpa").setup(
            impls.OpCall(TINY, 1, "attn_decode", 16, 40, 8, "full", 8, small, 32))

