"""Frontend test helpers: tiny HF models, the GPT-2 rules of docs/usage.md, and a mixed
prefill/decode run through a frontend model checked against the unmodified HF forward."""

from __future__ import annotations

import re
from contextlib import contextmanager
from functools import cache

import torch
from hf_models import TINY, randomize
from repo import ROOT

PROMPTS = {0: [3, 17, 5, 99, 42], 1: list(range(20, 31)), 2: [7, 7, 8, 200, 1, 64, 33]}


def tiny_hf(arch: str, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A tiny random HF model of `arch` (llama | qwen2 | mixtral | gpt2), fp32, eval mode."""
    import transformers as tf

    kw = {**TINY, "vocab_size": 256, "num_hidden_layers": layers}
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**kw))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**{**kw, "num_key_value_heads": 1}))
    elif arch == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**kw, num_local_experts=4,
                                                       num_experts_per_tok=2))
    else:
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=layers, n_head=4,
                                                 n_positions=256, vocab_size=256,
                                                 bos_token_id=0, eos_token_id=0))
    randomize(model, seed)
    return model.eval()


def hf_frontend(arch: str, layers: int = 2, **kw):
    """`tiny_hf(arch, layers)` routed through the frontend's operators and traced with its rules
    (`llama_rules()`, or docs/usage.md's for GPT-2): (HF model, `FrontendModel`)."""
    from nanosched.frontend import FrontendModel
    from nanosched.frontend.hf import llama_rules, use_nanosched

    model = tiny_hf(arch, layers)
    use_nanosched(model)
    rules = usage_rules()[0] if arch == "gpt2" else llama_rules()
    return model, FrontendModel(model, rules, **kw)


@cache
def shared_frontend(arch: str):
    """`hf_frontend(arch)` built once per test process, for tests that only read it and the
    model (each run makes its own workspace): a trace is 1.5-3 s of CPU, and five tests
    take the 2-layer Llama."""
    return hf_frontend(arch)


def usage_rules():
    """The GPT-2 rules as docs/usage.md gives them (its `gpt2-rules` block), executed."""
    text = (ROOT / "docs" / "usage.md").read_text()
    block = re.search(r"<!-- gpt2-rules -->\s*```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(block, scope)  # noqa: S102 - the documented example itself
    return scope["GPT2_RULES"], block


@contextmanager
def eager(model: torch.nn.Module):
    """The model's own attention (SDPA) and experts for the length of the block."""
    cfg = model.config
    saved = cfg._attn_implementation, getattr(cfg, "_experts_implementation", None)
    cfg._attn_implementation = "sdpa"
    if saved[1] is not None:
        cfg._experts_implementation = "eager"
    try:
        yield
    finally:
        cfg._attn_implementation = saved[0]
        if saved[1] is not None:
            cfg._experts_implementation = saved[1]


def run_mixed(fm, strategy, decode_steps: int = 3):
    """Three prompts prefilled in one batch (one of them chunked, its second chunk beside
    decode tokens), then greedy decode steps; returns (sequences, logits of every token)."""
    from nanosched.runtime.backend import Backend
    from nanosched.runtime.device import SerialDevice
    from nanosched.runtime.opsched import run_program

    ws = fm.new_workspace(max_tokens=32, num_pages=16)
    seqs = {r: list(p) for r, p in PROMPTS.items()}
    logits = {r: [] for r in PROMPTS}

    def batch(chunks):
        meta = ws.kv.plan([(r, len(ids), dec) for r, ids, dec in chunks])
        flat = [t for _, ids, _ in chunks for t in ids]
        ws.token_ids[: len(flat)] = torch.tensor(flat)
        segments = [(s, e, i < meta.num_decode)
                    for i, (s, e) in enumerate(zip(meta.seg_starts, meta.seg_ends, strict=True))]
        with torch.inference_mode():
            run_program(fm.program(ws, meta, segments), strategy, Backend(SerialDevice()))
            out = fm.logits(ws, torch.arange(len(flat)))
        row = 0
        for r, ids, _ in chunks:
            logits[r] += list(out[row: row + len(ids)])
            row += len(ids)
        for r, _, _ in chunks:
            if r != 1 or len(logits[1]) >= len(PROMPTS[1]):
                seqs[r].append(int(logits[r][-1].argmax()))

    batch([(0, seqs[0], False), (1, seqs[1][:6], False), (2, seqs[2], False)])
    batch([(0, seqs[0][-1:], True), (2, seqs[2][-1:], True), (1, seqs[1][6:], False)])
    for _ in range(decode_steps):
        batch([(r, seqs[r][-1:], True) for r in PROMPTS])
    return seqs, logits


def max_error_vs_hf(model, seqs, logits) -> float:
    """Largest |frontend - HF| / max |HF| over every token's logits (HF: each sequence once)."""
    worst = 0.0
    with eager(model), torch.inference_mode():
        for r, seq in seqs.items():
            ref = model(torch.tensor([seq[: len(logits[r])]]), use_cache=False).logits[0]
            got = torch.stack(logits[r])
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    return worst


def bucket_forward(fm, runner, chunks, ids):
    """One batch through a `BucketRunner` (its bucket's metadata, its graph once captured),
    laid out as the engine lays it; chunks (request, new tokens, is_decode), decode first, and
    their token ids. Returns the logits at each chunk's last row."""
    from nanosched.runtime.layout import lay_out

    ws = runner.ws
    seqs = ws.kv.plan_chunks(chunks)
    bucket = runner.bucket(seqs)
    assert bucket is not None
    lay = lay_out(seqs, [True] * len(seqs), bucket)
    flat = [0] * lay.num_rows
    for start, tokens in zip(lay.starts, ids, strict=True):
        flat[start:start + len(tokens)] = tokens
    ws.token_ids[: lay.num_rows] = torch.tensor(flat, device=ws.token_ids.device)
    runner.run(runner.entry(bucket), seqs)
    return fm.logits(ws, torch.tensor(lay.rows, device=ws.token_ids.device))


def plain_forward(fm, ws, chunks, ids):
    """The same batch on its own `BatchMeta` (no bucket), Sequential: logits at each chunk's
    last row."""
    from nanosched.runtime.backend import Backend
    from nanosched.runtime.device import CudaDevice, SerialDevice
    from nanosched.runtime.opsched import run_program
    from nanosched.runtime.strategies import Sequential

    meta = ws.kv.plan(chunks)
    flat = [t for tokens in ids for t in tokens]
    ws.token_ids[: len(flat)] = torch.tensor(flat, device=ws.token_ids.device)
    segments = [(s, e, i < meta.num_decode)
                for i, (s, e) in enumerate(zip(meta.seg_starts, meta.seg_ends, strict=True))]
    device = CudaDevice() if ws.token_ids.is_cuda else SerialDevice()
    run_program(fm.program(ws, meta, segments), Sequential(), Backend(device))
    return fm.logits(ws, torch.tensor(meta.seg_ends, device=ws.token_ids.device) - 1)


BUCKET_ROUNDS = [  # (request, new tokens, is_decode) and their ids: prompts, then mixed twice
    ([(0, 7, False), (1, 5, False)], [[3, 9, 27, 81, 5, 15, 45], [2, 4, 8, 16, 32]]),
    ([(0, 1, True), (1, 1, True), (2, 6, False)], [[11], [12], [5, 6, 7, 8, 9, 10]]),
    ([(0, 1, True), (1, 1, True), (3, 6, False)], [[13], [14], [50, 60, 70, 80, 90, 100]]),
]
