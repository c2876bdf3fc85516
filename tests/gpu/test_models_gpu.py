"""nanosched vs HF transformers on a GPU: Llama-3-8B shapes, 2 layers, random bf16 weights.

Four prompts (64..1000 tokens) are prefilled in one batch, then 8 greedy decode steps run for all
four through the paged cache (Triton decode attention, norm, rope and activation kernels; GEMMs
through cuBLAS or the persistent Triton GEMM). HF runs each final sequence once. Checks: logits
within bf16 tolerance (relative L2 error ≤ 2e-2), and top-1 agreement ≥ 99% over the positions
where HF's own top-2 margin exceeds the bf16 noise floor (logits are bf16, spaced 1/32 near 4;
closer calls are coin flips for any two bf16 implementations), which must be most positions.
"""

from __future__ import annotations

import pytest
import torch

from nanosched.kernels.dispatch import KernelOptions
from nanosched.models.checkpoint import StateDictSource, load_weights
from nanosched.models.model import CausalLM
from nanosched.models.spec import spec_from_hf_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT_LENS = [200, 517, 64, 1000]
DECODE_STEPS = 8
MARGIN = 0.1  # top-2 margin (logit units) below which a position is not decisive


@pytest.fixture(scope="module")
def hf_model():
    from bench.engine.frontend_llama import hf_llama

    return hf_llama(2)


def nanosched_run(hf, kernels: KernelOptions):
    """Prefill all prompts in one batch, decode DECODE_STEPS steps; logits per request."""
    spec = spec_from_hf_config(hf.config.to_dict() | {"architectures": ["LlamaForCausalLM"]},
                               name="llama3-8b-2l")
    model = CausalLM(spec, dtype=torch.bfloat16, device="cuda", kernels=kernels)
    load_weights(model, StateDictSource(hf.state_dict()), where="hf state_dict")
    ws = model.new_workspace(max_tokens=sum(PROMPT_LENS), num_pages=160)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    logits = [[] for _ in seqs]
    chunks = [(r, s, False) for r, s in enumerate(seqs)]
    with torch.inference_mode():
        for _ in range(DECODE_STEPS + 1):
            meta = ws.kv.plan([(r, len(ids), dec) for r, ids, dec in chunks])
            flat = [t for _, ids, _ in chunks for t in ids]
            ws.token_ids[: len(flat)] = torch.tensor(flat, device="cuda")
            out = model(ws, meta).float()  # [T, V]
            for (r, _, _), s, e in zip(chunks, meta.seg_starts, meta.seg_ends, strict=True):
                logits[r].append(out[s:e])
                seqs[r].append(int(out[e - 1].argmax()))
            chunks = [(r, [seqs[r][-1]], True) for r in range(len(seqs))]
    return seqs, [torch.cat(parts) for parts in logits]


@pytest.mark.parametrize("kernels", [KernelOptions(), KernelOptions(gemm="triton")],
                         ids=["cublas-gemm", "triton-gemm"])
def test_llama3_8b_shapes_match_hf_in_bf16(hf_model, kernels):
    seqs, logits = nanosched_run(hf_model, kernels)
    agree = decisive = total = 0
    for seq, ours in zip(seqs, logits, strict=True):
        with torch.no_grad():
            ref = hf_model(torch.tensor([seq[:-1]], device="cuda")).logits[0].float()
        assert ours.shape == ref.shape
        err = ((ours - ref).norm() / ref.norm()).item()
        assert err <= 2e-2, f"relative logit error {err:.3e}"
        top2 = ref.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > MARGIN
        agree += (ours.argmax(-1) == ref.argmax(-1))[sure].sum().item()
        decisive += sure.sum().item()
        total += len(sure)
    assert decisive >= 0.5 * total, f"only {decisive} of {total} positions are decisive"
    assert agree >= 0.99 * decisive, f"top-1 agreement {agree}/{decisive}"
