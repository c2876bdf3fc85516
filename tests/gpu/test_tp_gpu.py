"""Tensor parallelism over NCCL on two GPUs equals tp = 1 (fp32, so only summation order differs).

A Llama checkpoint with GQA (16 query / 8 KV heads, hidden 2048, 4 layers) saved by HF
transformers is loaded sharded by rank; a prefill batch and a decode step run through the paged
cache with the Triton kernels; rank 0's logits are compared with one GPU's, with the layers'
all-reduces on NCCL and on the copy engines (kernels/ce_allreduce.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from nanosched.constants import MULTICAST_OFF
from nanosched.kernels.dispatch import KernelOptions
from nanosched.models.checkpoint import load_checkpoint
from nanosched.models.model import CausalLM
from nanosched.models.parallel import TensorParallel, launch
from nanosched.models.spec import load_spec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

os.environ.update(MULTICAST_OFF)  # multicast stays off (shared hosts)


def logits_of(tp: TensorParallel, folder: str, network: str = "nccl") -> list[list[float]]:
    device = torch.device("cuda", tp.rank)
    if network != "nccl":
        tp = tp.with_copy_engine(device)
    model = CausalLM(load_spec(folder), tp=tp, dtype=torch.float32, device=device,
                     kernels=KernelOptions(network=network))
    load_checkpoint(model, folder)
    ws = model.new_workspace(512, 64)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        meta = ws.kv.plan([(0, 300, False), (1, 200, False)])
        ws.token_ids[:500].copy_(torch.randint(0, 1000, (500,), generator=g))
        first = model(ws, meta)
        meta = ws.kv.plan([(0, 1, True), (1, 1, True)])
        ws.token_ids[:2].copy_(torch.tensor([5, 6]))
        second = model(ws, meta)
    return torch.cat([first, second]).float().cpu().tolist()


@pytest.mark.parametrize("network", ["nccl", "copy_engine", "copy_engine_ctas8"])
def test_tp2_equals_tp1_on_two_gpus(tmp_path, network):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                      max_position_embeddings=2048, rope_theta=500000.0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    want = torch.tensor(logits_of(TensorParallel(), str(tmp_path)))
    got = torch.tensor(launch(logits_of, 2, "nccl", str(tmp_path), network))
    assert got.shape == want.shape == (502, 32000)
    assert ((got - want).norm() / want.norm()) < 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.99
