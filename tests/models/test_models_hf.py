"""nanosched models equal HF transformers on tiny random Llama, Qwen2 and Mixtral checkpoints.

Three prompts of different lengths are prefilled in one mixed batch (one prompt chunked over two
iterations, its second chunk next to decode tokens), then every request decodes 16 greedy steps
through the paged cache. HF then runs each full sequence once; every logit nanosched produced
must match HF's at the same position (fp32, 1e-4 relative) and every greedy token must be HF's
argmax. Mixtral (GQA group 2) and Qwen2 with one KV head (group 4) also run on the Triton
kernels (grouped expert GEMM, paged decode attention and paged prefill attention, the chunked
prompt's second chunk included) under TRITON_INTERPRET=1, with 2 decode steps to keep the
interpreter's time short.
"""

from __future__ import annotations

import os

import pytest
import torch
from hf_models import make_hf

from nanosched.kernels.dispatch import KernelOptions, triton_available
from nanosched.models.checkpoint import load_checkpoint
from nanosched.models.model import CausalLM
from nanosched.models.spec import load_spec

PROMPTS = {0: [3, 17, 5, 99, 42], 1: list(range(20, 31)), 2: [7, 7, 8, 200, 1, 64, 33]}
DECODE_STEPS = 16


def load(folder, kernels: KernelOptions | None = None) -> CausalLM:
    model = CausalLM(load_spec(str(folder)), kernels=kernels)
    load_checkpoint(model, folder)
    return model


def run_batch(model, ws, chunks, logits_of):
    """Run chunks (request, ids, is_decode); record logits of every token by (request, pos)."""
    start_pos = {r: ws.kv.length(r) for r, _, _ in chunks}
    meta = ws.kv.plan([(r, len(ids), dec) for r, ids, dec in chunks])
    flat = [t for _, ids, _ in chunks for t in ids]
    ws.token_ids[: len(flat)] = torch.tensor(flat)
    with torch.inference_mode():
        logits = model(ws, meta)  # [T, V]
    row = 0
    for r, ids, _ in chunks:
        for j in range(len(ids)):
            logits_of[r].append((start_pos[r] + j, logits[row]))
            row += 1


def generate_mixed(model, decode_steps: int = DECODE_STEPS):
    """The schedule of the module docstring; returns (sequences, logits by request)."""
    ws = model.new_workspace(max_tokens=32, num_pages=16)
    seqs = {r: list(p) for r, p in PROMPTS.items()}
    logits_of = {r: [] for r in PROMPTS}

    def next_token(r):
        seqs[r].append(int(logits_of[r][-1][1].argmax()))

    run_batch(model, ws, [(0, seqs[0], False), (1, seqs[1][:6], False), (2, seqs[2], False)],
              logits_of)
    next_token(0), next_token(2)
    run_batch(model, ws, [(0, seqs[0][-1:], True), (2, seqs[2][-1:], True),
                          (1, seqs[1][6:], False)], logits_of)
    for r in PROMPTS:
        next_token(r)
    while min(len(seqs[r]) - len(PROMPTS[r]) for r in PROMPTS) <= decode_steps:
        todo = [r for r in PROMPTS if len(seqs[r]) - len(PROMPTS[r]) <= decode_steps]
        run_batch(model, ws, [(r, seqs[r][-1:], True) for r in todo], logits_of)
        for r in todo:
            next_token(r)
    return seqs, logits_of


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("qwen2", {"num_key_value_heads": 1}),
    ("mixtral", {}),
])
def test_prefill_and_decode_match_hf(tmp_path, arch, overrides):
    hf = make_hf(arch, tmp_path, seed=1, **overrides)
    check_against_hf(hf, *generate_mixed(load(tmp_path)), arch, DECODE_STEPS)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
                    reason="needs triton and TRITON_INTERPRET=1 (set by tests/conftest.py)")
@pytest.mark.parametrize("arch, overrides", [("mixtral", {}),
                                             ("qwen2", {"num_key_value_heads": 1})])
def test_on_triton_kernels_matches_hf(tmp_path, arch, overrides):
    hf = make_hf(arch, tmp_path, seed=1, **overrides)
    model = load(tmp_path, KernelOptions("triton"))
    check_against_hf(hf, *generate_mixed(model, decode_steps=2), f"{arch}/triton", 2)


def check_against_hf(hf, seqs, logits_of, arch: str, decode_steps: int) -> None:
    """Every logit of every request equals HF's at its position; greedy tokens are HF's."""
    for r, seq in seqs.items():
        with torch.no_grad():
            ref = hf(torch.tensor([seq[:-1]])).logits[0]  # [len - 1, V]
        got = dict(logits_of[r])
        assert sorted(got) == list(range(len(seq) - 1))
        ours = torch.stack([got[p] for p in range(len(seq) - 1)])
        err = (ours - ref).abs().max() / ref.abs().max()
        assert err < 1e-4, f"{arch} request {r}: relative logit error {err:.2e}"
        first_new = len(PROMPTS[r])
        assert seq[first_new:] == ref[first_new - 1:].argmax(-1).tolist()
        assert len(seq) - first_new == decode_steps + 1


def test_tied_embeddings_match_hf(tmp_path):
    hf = make_hf("llama", tmp_path, seed=2, tie_word_embeddings=True, num_hidden_layers=1)
    model = load(tmp_path)
    assert model.lm_head is model.embed_tokens
    ws = model.new_workspace(16, 4)
    meta = ws.kv.plan([(0, 9, False)])
    ws.token_ids[:9] = torch.arange(9) * 5
    with torch.inference_mode():
        ours = model(ws, meta)
        ref = hf(torch.arange(9)[None] * 5).logits[0]
    assert ((ours - ref).abs().max() / ref.abs().max()) < 1e-4
