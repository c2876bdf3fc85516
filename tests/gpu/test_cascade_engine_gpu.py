"""`--decode-attention cascade` in the engine on a GPU: over a shared-prefix
workload with CUDA graphs, the cascade kernel runs inside the captured buckets, and the greedy
tokens are those of the default decode attention (fp32 model, so that only the order of the
attention's sums differs)."""

import pytest
import torch
from runtime_helpers import serve_all

from nanosched.kernels import cascade_attn
from nanosched.kernels.dispatch import KernelOptions
from nanosched.models.model import CausalLM
from nanosched.models.spec import REGISTRY
from nanosched.models.weights import init_random
from nanosched.runtime.requests import make_requests

pytestmark = pytest.mark.gpu

SPEC = REGISTRY["llama3-8b"].__class__(**{**REGISTRY["llama3-8b"].to_json(), "num_layers": 2,
                                          "name": "llama3-8b-2l"})


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_engine_with_cascade_in_graphs_gives_the_default_tokens(kv_dtype, monkeypatch):
    calls = []
    real = cascade_attn.cascade_decode_attention
    monkeypatch.setattr(cascade_attn, "cascade_decode_attention",
                        lambda *a, **k: calls.append(a[8].num_groups) or real(*a, **k))
    outs = []
    for decode in ("auto", "cascade"):
        model = CausalLM(SPEC, dtype=torch.float32, device="cuda",
                         kernels=KernelOptions(decode_impl=decode))
        init_random(model, seed=0)
        reqs = make_requests("shared-prefix:groups=4,prefix=600,unique=40,output=32", None,
                             None, 96, SPEC.vocab_size, 2048, seed=5)
        out, eng = serve_all(model, reqs, 8192, dense_batch=512, graphs="on", graph_align=32,
                             kv_dtype=kv_dtype)
        outs.append(out)
        assert eng.stats.graphs.replays > eng.stats.graphs.captures > 0
        del model, eng
    assert calls, "the cascade kernel never ran"
    same = sum(a == b for x, y in zip(*outs, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.98 * sum(len(x) for x in outs[0])
