"""Runtime on a GPU: strategies on real CUDA streams equal Sequential; async engine loop."""

import pytest
import torch
from runtime_helpers import serve_all

from nanosched.models.model import CausalLM
from nanosched.models.spec import REGISTRY
from nanosched.models.weights import init_random
from nanosched.runtime.backend import Backend
from nanosched.runtime.device import CudaDevice
from nanosched.runtime.modelprogram import model_program
from nanosched.runtime.opsched import run_program
from nanosched.runtime.requests import make_requests
from nanosched.runtime.strategies import Sequential, TwoBatchOverlap

pytestmark = pytest.mark.gpu

SPEC = REGISTRY["llama3-8b"].__class__(**{**REGISTRY["llama3-8b"].to_json(), "num_layers": 2,
                                          "name": "llama3-8b-2l"})


@pytest.fixture(scope="module")
def model():
    m = CausalLM(SPEC, dtype=torch.bfloat16, device="cuda")
    init_random(m, seed=0)
    return m


def forward_logits(model, strategy, n_decode=384, prompt=640, n_prompts=2):
    """One mixed batch: decode tokens (with 1,024 tokens of cache each) then prefill chunks."""
    ws = model.new_workspace(max_tokens=n_decode + prompt * n_prompts, num_pages=40_000)
    g = torch.Generator().manual_seed(0)
    for r in range(n_decode):  # give decode requests cached context
        ws.kv.plan([(r, 1024, False)])
    chunks = [(r, 1, True) for r in range(n_decode)] + \
        [(10_000 + p, prompt, False) for p in range(n_prompts)]
    meta = ws.kv.plan(chunks)
    n = n_decode + prompt * n_prompts
    ws.token_ids[:n].copy_(torch.randint(0, SPEC.vocab_size, (n,), generator=g))
    ws.kv.k.normal_(generator=torch.Generator("cuda").manual_seed(1))
    ws.kv.v.normal_(generator=torch.Generator("cuda").manual_seed(2))
    segments, row = [], 0
    for _, num, is_decode in chunks:
        segments.append((row, row + num, is_decode))
        row += num
    program = model_program(model, ws, meta, segments)
    with torch.inference_mode():
        run_program(program, strategy, Backend(CudaDevice()))
        return model.logits(ws, torch.arange(n, device="cuda")).float()


def test_two_batch_overlap_on_streams_equals_sequential(model):
    ref = forward_logits(model, Sequential())
    got = forward_logits(model, TwoBatchOverlap())
    err = (got - ref).norm() / ref.norm()
    assert err < 2e-2, err
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.97


def test_async_engine_loop_equals_synchronous(model):
    outs = []
    for is_async in (False, True):
        reqs = make_requests(None, 200, 24, 48, SPEC.vocab_size, 4096, seed=3)
        outs.append(serve_all(model, reqs, 4096, dense_batch=512, async_loop=is_async)[0])
    assert outs[0] == outs[1]
