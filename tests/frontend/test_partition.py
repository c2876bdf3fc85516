"""Partition rules on a model of the user's own: `mark`, `SplitFunc`, resource classes, errors.

`Toy` is a pre-norm decoder (each layer's norm, and the final one, close the layer before it)
written without any of the project's code except the attention hook (`hf.attention_forward`,
which an HF model reaches through its attention interface); its FFN activation sits in a
`mark("act")` block. The partition's ops, their order and resource classes come from the
rules; a prompt run through the frontend (Sequential, and two batches on a reordering device)
equals the toy's own forward with SDPA attention.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from runtime_helpers import ShuffledDevice
from torch import nn

from nanosched.errors import ConfigError
from nanosched.frontend import FrontendModel, Rules, SplitFunc, SplitModule, mark
from nanosched.frontend.hf import attention_forward
from nanosched.runtime.backend import Backend
from nanosched.runtime.device import SerialDevice
from nanosched.runtime.opsched import run_program
from nanosched.runtime.strategies import Sequential, TwoBatchOverlap

D, HEADS, VOCAB = 32, 4, 64


class Block(nn.Module):
    def __init__(self, layer: int, with_act: bool = True) -> None:
        super().__init__()
        self.layer_idx, self.with_act = layer, with_act
        self.norm = nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.sdpa = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = (t.view(1, -1, HEADS, D // HEADS).transpose(1, 2)
                   for t in self.qkv(h).chunk(3, dim=-1))
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        else:
            a = attention_forward(self, q, k, v, None)[0]
        x = x + self.o(a.reshape(1, -1, D))
        h = self.up(x)
        if self.with_act:
            with mark("act"):
                h = torch.tanh(h) * 0.5
        return x + self.down(h)


class Toy(nn.Module):
    def __init__(self, layers: int = 2, act_in_odd_layers: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block(i, act_in_odd_layers or i % 2 == 0)
                                    for i in range(layers))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


RULES = Rules((
    SplitModule("*.qkv", "kqv"),
    SplitFunc(F.scaled_dot_product_attention, "attn"),  # unused here: the toy's SDPA path
    SplitModule("*.o", "o"),
    SplitModule(nn.LayerNorm, "norm", resource="memory"),
    SplitModule("*.up", "up"),
    SplitModule("*.down", "down"),
))


def toy(**kw) -> Toy:
    torch.manual_seed(0)
    return Toy(**kw).eval()


def prompt_logits(fm: FrontendModel, strategy, device, ids: list[int]) -> torch.Tensor:
    ws = fm.new_workspace(max_tokens=16, num_pages=8, page_size=4)
    meta = ws.kv.plan([(0, len(ids), False)])
    ws.token_ids[: len(ids)] = torch.tensor(ids)
    with torch.inference_mode():
        run_program(fm.program(ws, meta, [(0, len(ids), False)]), strategy, Backend(device))
        return fm.logits(ws, torch.arange(len(ids)))


def test_marks_and_rules_make_the_ops_of_the_users_model():
    model = toy()
    fm = FrontendModel(model, RULES)
    assert fm.layer_ops() == [("kqv", "compute"), ("rope_append", "other"),
                              ("attn_decode", "memory"), ("attn_prefill", "compute"),
                              ("o", "compute"), ("up", "compute"), ("act", "other"),
                              ("down", "compute"), ("norm", "memory")]
    ids = [5, 9, 2, 33, 7, 1, 60, 12, 3, 3]
    for layer in model.layers:
        layer.sdpa = True
    with torch.inference_mode():
        want = model(torch.tensor([ids]))[0]
    got = prompt_logits(fm, Sequential(), SerialDevice(), ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got = prompt_logits(fm, TwoBatchOverlap(tile_m=2), ShuffledDevice(3), ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_first_op_no_node_matches_is_refused():
    rules = Rules((SplitModule("*.nothing_here", "missing"), *RULES.rules))
    with pytest.raises(ConfigError, match="no node of the traced graph matches the rules of "
                                          "op 'missing'"):
        FrontendModel(toy(), rules)


def test_an_op_on_both_sides_of_another_is_refused():
    rules = Rules((SplitModule("*.qkv", "kqv"), SplitModule("*.o", "x"), SplitModule("*.up", "y"),
                   SplitModule("*.down", "x")))  # x before and after y: a cycle
    with pytest.raises(ConfigError, match="cycle"):
        FrontendModel(toy(), rules)


def test_layers_with_different_ops_are_refused():
    with pytest.raises(ConfigError, match="layer 1 partitions into ops"):
        FrontendModel(toy(act_in_odd_layers=False), RULES)


def test_bad_rules_are_refused():
    with pytest.raises(ConfigError, match="resource 'gpu' is not one of"):
        Rules((SplitModule("*.qkv", "kqv", resource="gpu"),))
    with pytest.raises(ConfigError, match="reserved"):
        Rules((SplitModule("*.qkv", "head"),))
    with pytest.raises(ConfigError, match="first_op 'x' is not the op of any rule"):
        Rules((SplitModule("*.qkv", "kqv"),), first_op="x")
