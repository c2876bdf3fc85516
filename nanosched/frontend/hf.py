"""HF transformers models through the frontend: their hooks, and the rules of the Llama family.

`use_nanosched(model)` points the model's attention implementation (HF's `AttentionInterface`)
and, for MoE models, its experts implementation (`ExpertsInterface`) at the functions below,
which call the frontend's operators (custom_ops.py): the same switch as
`attn_implementation="sdpa"`, a setting of the model's config, not a change of its code.
Without a mask function registered for it, HF builds no attention mask: the paged kernels take
the batch layout from the batch metadata instead (decode rows first, then prompt chunks, all in
one sequence of T tokens).

`llama_rules()` partitions HF Llama, Qwen2, Mistral and Mixtral into the project's named ops
(models/ops.py), so that a schedule searched on the named-op model's profile replays on them.
"""

from __future__ import annotations

from typing import Any

import torch

from nanosched.errors import ConfigError
from nanosched.frontend import custom_ops
from nanosched.frontend.rules import Rule, Rules, SplitFunc, SplitModule
from nanosched.models.ops import OPS

IMPLEMENTATION = "nanosched"
# attention variants the kernels lack
UNSUPPORTED_ATTENTION = ("sliding_window", "softcap", "s_aux")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                      dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF attention interface: causal paged attention of the batch's rows. query [1, Hq, T, d],
    key, value [1, Hkv, T, d] (rotated); returns [1, T, Hq, d] as HF's SDPA path does."""
    for name in UNSUPPORTED_ATTENTION:
        if kwargs.get(name) is not None:
            raise ConfigError(f"attention with {name}={kwargs[name]!r} (layer "
                              f"{module.layer_idx}) is not supported by the frontend's kernels")
    if query.shape[0] != 1:
        raise ConfigError(f"the frontend runs one sequence of T tokens (batch 1), got batch "
                          f"{query.shape[0]}")
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    custom_ops.KV_APPEND(key, value, layer)
    out = query.new_empty((1, query.shape[2], query.shape[1], query.shape[3]))
    custom_ops.ATTN_DECODE(query, out, layer, scale)
    custom_ops.ATTN_PREFILL(query, out, layer, scale)
    return out, None


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF experts interface (gate_up [E, 2I, D] and down [E, D, I] weights, gated): grouped
    GEMMs over token-major rows, HF's own gating (`_apply_gate`) between them."""
    if getattr(self, "is_transposed", False) or getattr(self, "has_bias", False) or \
            not getattr(self, "has_gate", True):
        raise ConfigError(f"{type(self).__name__}: the frontend's experts take gated, "
                          f"untransposed, bias-free expert weights")
    n, k = top_k_index.shape
    gate_up = hidden_states.new_empty((n * k, self.gate_up_proj.shape[1]))
    custom_ops.EXPERTS_UG(hidden_states, top_k_index, self.gate_up_proj, gate_up)
    act = self._apply_gate(gate_up)
    out = hidden_states.new_empty((n, hidden_states.shape[1]))
    custom_ops.EXPERTS_D(act, top_k_index, top_k_weights, self.down_proj, out)
    return out


def use_nanosched(model: torch.nn.Module) -> None:
    """Route `model`'s attention (and experts) through the frontend's operators."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    model.config._attn_implementation = IMPLEMENTATION
    if any(hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and
           m.gate_up_proj.dim() == 3 for m in model.modules()):
        from transformers.integrations.moe import ExpertsInterface

        ExpertsInterface.register(IMPLEMENTATION, experts_forward)
        model.config._experts_implementation = IMPLEMENTATION


def table_rules(kinds: tuple[str, ...] = ("module", "func", "op")) -> tuple[Rule, ...]:
    """The op table's HF rules of `kinds` (models/ops.py `OpSpec.hf`), by rank: "op" names a
    frontend operator (custom_ops.py), "func" a function, "module" a module path glob."""
    rules: list[tuple[int, Rule]] = []
    for spec in OPS:
        for rank, kind, target, inside in spec.hf:
            if kind not in kinds:
                continue
            rule: Rule = (SplitModule(target, spec.name) if kind == "module" else
                          SplitFunc(getattr(custom_ops, target) if kind == "op" else target,
                                    spec.name, inside=inside))
            rules.append((rank, rule))
    return tuple(r for _, r in sorted(rules, key=lambda x: x[0]))


def llama_rules() -> Rules:
    """HF Llama / Qwen2 / Mistral / Mixtral as the named ops of models/ops.py (tp = 1)."""
    return Rules(table_rules())
