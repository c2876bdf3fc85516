"""The frontend on a GPU: HF Llama at Llama-3-8B shapes (2 layers, random bf16 weights).

- Four prompts (64..1000 tokens) prefilled in one batch, then 8 greedy decode steps, through
  HF's own `LlamaForCausalLM` partitioned by `llama_rules()` (Triton paged attention, GEMMs
  through the project's dispatch) against the same model's eager SDPA forward: relative L2
  error of the logits ≤ 2e-2 and top-1 agreement ≥ 99% where HF's top-2 margin exceeds the bf16
  noise floor (tests/gpu/test_models_gpu.py's criteria).
- CUDA graphs: batches laid out in the engine's buckets, captured across the strategy's
  streams (Sequential, and the two-batch overlap on two streams) and replayed, equal the same
  batches run eagerly on their own metadata; the elementwise ops Inductor compiles by default
  give the uncompiled frontend's logits, and nothing compiles after initialisation.

    PYTHONPATH=. python -m pytest -m gpu tests/gpu/test_frontend_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from frontend_helpers import BUCKET_ROUNDS, bucket_forward, eager, plain_forward

from nanosched.frontend import FrontendModel
from nanosched.frontend.hf import llama_rules, use_nanosched
from nanosched.runtime.backend import Backend
from nanosched.runtime.device import CudaDevice
from nanosched.runtime.graphs import BucketRunner
from nanosched.runtime.opsched import run_program
from nanosched.runtime.strategies import Sequential, TwoBatchOverlap

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT_LENS = [200, 517, 64, 1000]
DECODE_STEPS = 8
MARGIN = 0.1  # top-2 margin (logit units) below which a position is not decisive


@pytest.fixture(scope="module")
def models():
    from bench.engine.frontend_llama import hf_llama

    hf = hf_llama(2)
    use_nanosched(hf)
    return hf, FrontendModel(hf, llama_rules())


def frontend_run(fm: FrontendModel):
    """Prefill all prompts in one batch, decode DECODE_STEPS steps; logits per request."""
    ws = fm.new_workspace(max_tokens=sum(PROMPT_LENS), num_pages=160)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    logits = [[] for _ in seqs]
    chunks = [(r, s, False) for r, s in enumerate(seqs)]
    with torch.inference_mode():
        for _ in range(DECODE_STEPS + 1):
            meta = ws.kv.plan([(r, len(ids), dec) for r, ids, dec in chunks])
            flat = [t for _, ids, _ in chunks for t in ids]
            ws.token_ids[: len(flat)] = torch.tensor(flat, device="cuda")
            segments = [(s, e, i < meta.num_decode) for i, (s, e) in
                        enumerate(zip(meta.seg_starts, meta.seg_ends, strict=True))]
            run_program(fm.program(ws, meta, segments), Sequential(), Backend(CudaDevice()))
            out = fm.logits(ws, torch.arange(len(flat), device="cuda")).float()
            for (r, _, _), s, e in zip(chunks, meta.seg_starts, meta.seg_ends, strict=True):
                logits[r].append(out[s:e])
                seqs[r].append(int(out[e - 1].argmax()))
            chunks = [(r, [seqs[r][-1]], True) for r in range(len(seqs))]
    return seqs, [torch.cat(parts) for parts in logits]


def test_hf_llama_through_the_frontend_matches_its_eager_forward_in_bf16(models):
    hf, fm = models
    seqs, logits = frontend_run(fm)
    agree = decisive = 0
    with torch.inference_mode(), eager(hf):
        for seq, got in zip(seqs, logits, strict=True):
            want = hf(torch.tensor([seq[:-1]], device="cuda"), use_cache=False).logits[0].float()
            assert torch.linalg.norm(got - want) / torch.linalg.norm(want) <= 2e-2
            top2 = want.topk(2, dim=-1).values
            mask = (top2[:, 0] - top2[:, 1]) > MARGIN
            decisive += int(mask.sum())
            agree += int((got.argmax(-1) == want.argmax(-1))[mask].sum())
    assert decisive > 0.5 * sum(len(s) - 1 for s in seqs)
    assert agree >= 0.99 * decisive


@pytest.mark.parametrize("strategy", [Sequential(), TwoBatchOverlap(tile_m=8)],
                         ids=["sequential", "two_batch"])
def test_graph_buckets_replay_what_eager_runs(models, strategy):
    _, fm = models
    ref_ws = fm.new_workspace(max_tokens=64, num_pages=32)
    ws = fm.new_workspace(max_tokens=64, num_pages=32)
    device = CudaDevice()
    runner = BucketRunner(fm, ws, Backend(device), strategy, align=8, max_pages=16,
                          capture=True)
    with torch.inference_mode():
        for chunks, ids in BUCKET_ROUNDS:
            want = plain_forward(fm, ref_ws, chunks, ids).float()
            got = bucket_forward(fm, runner, chunks, ids).float()
            assert torch.linalg.norm(got - want) / torch.linalg.norm(want) <= 2e-2
    assert not runner.errors
    assert runner.stats.captures >= 1 and runner.stats.replays >= 1


def test_a_quick_profile_measures_every_op_of_the_frontend(models, tmp_path):
    """`nanosched profile --frontend`'s path on the GPU: the frontend's own ops timed alone
    (every op of the layer has rows) and in pairs, at a small dense batch."""
    from nanosched.frontend.profiling import FrontendImpls, model_spec
    from nanosched.profiler.command import ProfileConfig, profile_gpu
    from nanosched.workloads import fixed

    _, fm = models
    spec = model_spec(fm, "hf-llama3-8b-2l")
    cfg = ProfileConfig(torch.cuda.current_device(), spec.name, 1, fixed(1024, 512),
                        tmp_path / "p.json", quick=True, dense_batch=256, progress=False,
                        spec=spec, registry=FrontendImpls(fm))
    prof = profile_gpu(cfg, log=lambda _: None)
    assert {k.op for k in prof.kernels} == set(fm.op_names())
    assert prof.pairs and all(k.time_us > 0 for k in prof.kernels)


def test_inductor_compiled_ops_in_graph_buckets(models):
    """By default on a GPU the elementwise ops (norms, rotary + KV append, activation) are
    compiled by TorchInductor at initialisation; captured in a bucket's graph and replayed,
    they give the uncompiled frontend's logits (bf16 rounding), with no compile after init."""
    hf, fm = models
    assert fm.compiled_ops == ("rope_append", "add_norm_ffn", "act", "add_norm_attn")
    assert fm.compile_seconds > 0
    plain = FrontendModel(hf, llama_rules(), compile_ops=())
    ref_ws = plain.new_workspace(max_tokens=64, num_pages=32)
    ws = fm.new_workspace(max_tokens=64, num_pages=32)
    runner = BucketRunner(fm, ws, Backend(CudaDevice()), Sequential(), align=8,
                          max_pages=16, capture=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for chunks, ids in BUCKET_ROUNDS:
            want = plain_forward(plain, ref_ws, chunks, ids).float()
            got = bucket_forward(fm, runner, chunks, ids).float()
            assert torch.linalg.norm(got - want) / torch.linalg.norm(want) <= 2e-2
    assert not runner.errors and runner.stats.replays >= 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
