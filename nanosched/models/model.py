"""Llama-family (Llama-2/3, DeepSeek-67B, Qwen2 with QKV bias) and Mixtral models as named ops.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanosched.constants import PAGE_SIZE
from nanosched.errors import ConfigError
from nanosched.kernels import dispatch as K
from nanosched.kernels.dispatch import KernelOptions
from nanosched.models import op_impls, quant
from nanosched.models.batch import BatchMeta
from nanosched.models.kvcache import KVCache
from nanosched.models.ops import COLLECTIVES
from nanosched.models.ops import layer_ops as op_defs
from nanosched.models.parallel import LocalShapes, TensorParallel, local_shapes
from nanosched.models.rope import rope_tables
from nanosched.models.spec import ModelSpec
from nanosched.models.workspace import Workspace, allocate_workspace


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    """The weights of one decoder layer in local (tp-sharded) shapes; the ops live elsewhere.

    w_qkv [(Hq + 2 Hkv) d, D] rows q | k | v; w_o [D, Hq d]; dense: w_gate_up [2I, D] rows
    gate | up, w_down [D, I]; MoE: router [E, D], w_gate_up [E, 2I, D], w_down [E, D, I].
    Quantised (`quant.FP8`): each weight named in `fp8_weights` is e4m3 beside its fp32 scale
    per output row, `{name}_scale` [N] (experts: [E, N]; models/quant.py).
    """

    def __init__(self, spec: ModelSpec, local: LocalShapes, dtype: torch.dtype,
                 device: torch.device | str, quantization: str = quant.NONE) -> None:
        super().__init__()
        d, inter = spec.hidden_size, local.intermediate
        kw = {"dtype": dtype, "device": device}
        self.spec = spec
        self.fp8_weights = quant.fp8_weights(spec, quantization)

        def weight(name: str, *shape: int) -> nn.Parameter:
            if name not in self.fp8_weights:
                return _param(*shape, **kw)
            self.register_parameter(f"{name}_scale", _param(*shape[:-1], dtype=torch.float32,
                                                            device=device))
            return _param(*shape, dtype=quant.FP8_DTYPE, device=device)

        self.attn_norm = _param(d, **kw)
        self.w_qkv = weight("w_qkv", local.qkv_size, d)
        self.b_qkv = _param(local.qkv_size, **kw) if spec.qkv_bias else None
        self.w_o = weight("w_o", d, local.q_size)
        self.ffn_norm = _param(d, **kw)
        if spec.is_moe:
            self.router = _param(spec.num_experts, d, **kw)
            self.w_gate_up = weight("w_gate_up", spec.num_experts, 2 * inter, d)
            self.w_down = weight("w_down", spec.num_experts, d, inter)
        else:
            self.router = None
            self.w_gate_up = weight("w_gate_up", 2 * inter, d)
            self.w_down = weight("w_down", d, inter)

    def is_fp8(self, name: str) -> bool:
        """Whether weight `name` is e4m3 (its GEMM takes an e4m3 input with row scales)."""
        return name in self.fp8_weights

    def e4m3_input(self, name: str) -> bool:
        """Whether the kernel before weight `name`'s GEMM writes its input in e4m3
        (`quant.producer_writes_e4m3`)."""
        return quant.producer_writes_e4m3(self.spec, name, self.fp8_weights)


class CausalLM(nn.Module):
    """A decoder-only LM whose layers run as the named ops of `nanosched.models.ops`."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kernels: KernelOptions | None = None, quantization: str = quant.NONE) -> None:
        super().__init__()
        self.spec = spec
        self.quantization = quant.check_quantization(quantization)
        quant.check_model_dtype(self.quantization, dtype)
        quant.check_fp8_device(self.quantization, device)
        self.tp = tp or TensorParallel()
        self.local = local_shapes(spec, self.tp)
        self.dtype = dtype
        self.device = torch.device(device)
        self.kernels = kernels or KernelOptions()
        self.scale = spec.head_dim ** -0.5
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = _param(self.local.vocab, spec.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(spec, self.local, dtype, device, quantization)
                                    for _ in range(spec.num_layers))
        self.final_norm = _param(spec.hidden_size, **kw)
        self.lm_head = (self.embed_tokens if spec.tie_word_embeddings
                        else _param(self.local.vocab, spec.hidden_size, **kw))
        cos, sin = rope_tables(spec, device)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_pos, d/2] fp32
        self.register_buffer("rope_sin", sin, persistent=False)
        self._ops = [op.name for op in op_defs(spec, self.tp.size)]

    def op_names(self) -> list[str]:
        """The layer's ops in program order (network ops only when tp > 1)."""
        return list(self._ops)

    def new_workspace(self, max_tokens: int, num_pages: int, page_size: int = PAGE_SIZE,
                      kv_dtype: str = "auto") -> Workspace:
        """Buffers for batches of up to `max_tokens` tokens and a cache of `num_pages` pages
        (`kv_dtype`: "auto" = the model's dtype, "fp8" = e4m3 with scales; models/kvcache.py)."""
        kv = KVCache(self.spec.num_layers, num_pages, self.local.num_kv_heads,
                     self.spec.head_dim, self.dtype, self.device, page_size, kv_dtype)
        return self._workspace(max_tokens, kv, self.device, self.tp.symmetric_zeros)

    def buffer_bytes(self, max_tokens: int) -> int:
        """Bytes of `new_workspace`'s activation buffers for `max_tokens` tokens, its KV cache
        aside: the same buffers, laid out on the meta device (nothing allocated)."""
        ws = self._workspace(max_tokens, None, torch.device("meta"), None)
        return sum(t.numel() * t.element_size() for t in vars(ws).values()
                   if isinstance(t, torch.Tensor))

    def _workspace(self, max_tokens: int, kv: KVCache | None, device: torch.device,
                   reduced: Any) -> Workspace:
        s, loc = self.spec, self.local
        k = s.num_experts_per_tok if s.is_moe else 1
        return allocate_workspace(
            max_tokens=max_tokens, hidden=s.hidden_size, qkv_size=loc.qkv_size,
            num_heads=loc.num_heads, head_dim=s.head_dim, intermediate=loc.intermediate,
            experts_per_token=k, is_moe=s.is_moe, kv=kv, dtype=self.dtype, device=device,
            reduced=reduced, fp8=self.quantization == quant.FP8)

    def norm_before(self, layer: int) -> torch.Tensor:
        """The RMSNorm weight applied before layer `layer` (the final norm after the last)."""
        return self.layers[layer].attn_norm if layer < len(self.layers) else self.final_norm

    def normed_out(self, ws: Workspace, layer: int, weight: str, start: int,
                   end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where a norm writes rows [start, end) for the GEMM of `weight` in layer `layer`
        (past the last layer: the LM head): e4m3 rows and their scales when the norm writes
        that GEMM's input in e4m3 (`DecoderLayer.e4m3_input`), else the model-dtype rows."""
        if layer < len(self.layers) and self.layers[layer].e4m3_input(weight):
            return ws.normed8[start:end], ws.normed_scale[start:end]
        return ws.normed[start:end], None

    def embed(self, ws: Workspace, meta: BatchMeta, start: int, end: int) -> None:
        """Look up ws.token_ids[start:end] into the residual stream and norm it for layer 0."""
        ids = ws.token_ids[start:end]  # [n]
        local = ids - self.local.vocab_start
        valid = (local >= 0) & (local < self.local.vocab)
        h = F.embedding(local.clamp(0, self.local.vocab - 1), self.embed_tokens)  # [n, D]
        res = ws.residual[start:end]
        torch.mul(h, valid[:, None].to(h.dtype), out=res)
        self.tp.all_reduce(res)
        out, scale = self.normed_out(ws, 0, "w_qkv", start, end)
        K.rms_norm_add(res, None, self.norm_before(0), self.spec.rms_norm_eps, out, res,
                       self.kernels, out_scale=scale)

    def run_op(self, layer: int, name: str, ws: Workspace, meta: BatchMeta, start: int,
               end: int, launch: dict | None = None) -> None:
        """Run op `name` of layer `layer` on tokens [start, end) (global batch coordinates)."""
        fn = op_impls.OP_FUNCTIONS.get(name)
        if fn is None or name not in self._ops and name not in COLLECTIVES:
            raise ConfigError(f"op {name!r} is not an op of model {self.spec.name!r}; "
                              f"ops: {', '.join(self._ops)}")
        if start < end:
            fn(self, layer, ws, meta, start, end, launch)

    def logits(self, ws: Workspace, rows: torch.Tensor | None = None,
               num_tokens: int | None = None) -> torch.Tensor:
        """LM-head logits [len(rows), V] of the normed rows (all `num_tokens` rows if None)."""
        h = ws.normed[:num_tokens] if rows is None else ws.normed.index_select(0, rows)
        out = torch.empty((h.shape[0], self.local.vocab), dtype=self.dtype, device=self.device)
        K.linear(h, self.lm_head, None, out, self.kernels)
        return self.tp.all_gather_cols(out)[:, : self.spec.vocab_size]

    def forward(self, ws: Workspace, meta: BatchMeta,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Sequential reference: embed, every op of every layer over the batch, logits."""
        if meta.start != 0:
            raise ConfigError(f"forward runs a whole batch; got the range [{meta.start}, "
                              f"{meta.end})")
        n = meta.end
        self.embed(ws, meta, 0, n)
        for layer in range(self.spec.num_layers):
            for name in self._ops:
                self.run_op(layer, name, ws, meta, 0, n)
        return self.logits(ws, rows, num_tokens=n)
