"""A tiny random GPT-2 through the frontend, for `nanosched profile --frontend
tests/data/frontend_gpt2.py:build` (the CLI test's model; the rules are docs/usage.md's)."""

import torch
import transformers

from nanosched.frontend import FrontendModel, Rules, SplitModule
from nanosched.frontend.hf import use_nanosched

GPT2_RULES = Rules((
    SplitModule("*.attn.c_attn", "kqv"),
    SplitModule("*.attn.c_proj", "o"),
    SplitModule("*.ln_2", "add_norm_ffn"),
    SplitModule("*.mlp.c_fc", "ug"),
    SplitModule("*.mlp.act", "act"),
    SplitModule("*.mlp.c_proj", "d"),
    SplitModule("*.ln_1", "add_norm_attn"),
    SplitModule("*.ln_f", "add_norm_attn"),
))


def build(device: str) -> FrontendModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                                  vocab_size=256, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).to(device).eval()
    use_nanosched(model)
    return FrontendModel(model, GPT2_RULES)
