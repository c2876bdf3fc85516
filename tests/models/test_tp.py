"""Tensor parallelism: tp = 2 on CPU (gloo, two spawned processes) equals tp = 1.

Covers split KV heads (Llama), a replicated KV head plus QKV bias and a padded vocabulary shard
(Qwen2 with 1 KV head, V = 251) and sharded experts (Mixtral), over a prefill batch and a decode
step, so every all-reduce op and the vocab-parallel embedding / LM head take part; the layers'
all-reduces on gloo and on the copy-engine all-reduce's host transport.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import make_hf

from nanosched.kernels.dispatch import KernelOptions
from nanosched.models.checkpoint import load_checkpoint
from nanosched.models.model import CausalLM
from nanosched.models.parallel import TensorParallel, launch
from nanosched.models.spec import load_spec

CASES = [("llama", {}), ("qwen2", {"num_key_value_heads": 1, "vocab_size": 251}),
         ("mixtral", {})]


def logits_of(tp: TensorParallel, folders: list[str],
              network: str = "nccl") -> list[list[list[float]]]:
    """Logits of a prefill batch and a decode step for each checkpoint, on this rank, with the
    layers' all-reduces on `network` (copy_engine: the host transport in shared memory)."""
    torch.set_num_threads(1)
    if network == "copy_engine":
        tp = tp.with_copy_engine(torch.device("cpu"))
    results = []
    for folder in folders:
        model = CausalLM(load_spec(folder), tp=tp, kernels=KernelOptions(network=network))
        load_checkpoint(model, folder)
        ws = model.new_workspace(16, 8)
        with torch.inference_mode():
            meta = ws.kv.plan([(0, 7, False), (1, 4, False)])
            ws.token_ids[:11] = torch.arange(11) * 13 % 250
            first = model(ws, meta)
            meta = ws.kv.plan([(0, 1, True), (1, 1, True)])
            ws.token_ids[:2] = torch.tensor([5, 6])
            second = model(ws, meta)
        results.append(torch.cat([first, second]).tolist())
    return results


@pytest.mark.slow
@pytest.mark.parametrize("network", ["nccl", "copy_engine"])
def test_tp2_equals_tp1(tmp_path, network):
    folders = []
    for i, (arch, overrides) in enumerate(CASES):
        folder = tmp_path / arch
        make_hf(arch, folder, seed=20 + i, **overrides)
        folders.append(str(folder))
    want = logits_of(TensorParallel(), folders)
    got = launch(logits_of, 2, "gloo", folders, network)
    for (arch, _), a, b in zip(CASES, got, want, strict=True):
        a, b = torch.tensor(a), torch.tensor(b)
        assert a.shape == b.shape == (13, 251 if arch == "qwen2" else 256)
        assert ((a - b).abs().max() / b.abs().max()) < 1e-5, arch
