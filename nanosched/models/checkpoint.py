"""Load an HF checkpoint (config.json + *.safetensors, optionally sharded with
model.safetensors.index.json) into a `CausalLM`, reading only this tp rank's slices.

Never goes through pickle: tensors are read with `safetensors.safe_open(...).get_slice`, so a
rank reads its rows/columns only. Every tensor the model needs must be present with its HF
shape, and every tensor in the checkpoint must be used (rotary `inv_freq` buffers and a tied
`lm_head.weight` are ignored); otherwise a ConfigError names the tensor and the shapes.
HF names: Llama/Qwen2 `model.layers.N.self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`;
Mixtral `block_sparse_moe.gate` and `block_sparse_moe.experts.E.{w1,w3,w2}` (gate, up, down).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from nanosched.errors import ConfigError
from nanosched.models.model import CausalLM
from nanosched.models.spec import REGISTRY

Range = tuple[int, int] | None


@dataclass
class Target:
    """One HF tensor: its full shape, and which rows/columns of it go into `dest`."""

    name: str
    shape: tuple[int, ...]
    dest: torch.Tensor
    rows: Range = None
    cols: Range = None


class SafetensorsFolder:
    """The tensors of a checkpoint folder, opened lazily, sliced on read."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"checkpoint {self.folder}: no *.safetensors files")
        self._where: dict[str, object] = {}
        for f in files:
            path = self.folder / f
            if not path.is_file():
                raise ConfigError(f"checkpoint {self.folder}: index names missing file {f}")
            handle = safe_open(str(path), framework="pt")
            self._where.update(dict.fromkeys(handle.keys(), handle))

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str, rows: Range, cols: Range) -> torch.Tensor:
        sl = self._where[name].get_slice(name)
        if cols is not None:
            r = slice(*rows) if rows else slice(None)
            return sl[r, cols[0]:cols[1]]
        return sl[rows[0]:rows[1]] if rows else sl[:]


class StateDictSource:
    """An in-memory {name: tensor} (e.g. an HF model's state_dict) read like a checkpoint."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, rows: Range, cols: Range) -> torch.Tensor:
        t = self.tensors[name]
        t = t[rows[0]:rows[1]] if rows else t
        return t[:, cols[0]:cols[1]] if cols else t


def _targets(model: CausalLM) -> Iterator[Target]:
    s, loc = model.spec, model.local
    hid, hd = s.hidden_size, s.head_dim
    n_vocab = max(0, min(s.vocab_size - loc.vocab_start, loc.vocab))
    vocab = (loc.vocab_start, loc.vocab_start + n_vocab)
    yield Target("model.embed_tokens.weight", (s.vocab_size, hid),
                 model.embed_tokens[:n_vocab], rows=vocab)
    q_rows = (loc.q_head_start * hd, loc.q_head_start * hd + loc.q_size)
    kv_rows = (loc.kv_head_start * hd, loc.kv_head_start * hd + loc.kv_size)
    inter = (loc.inter_start, loc.inter_start + loc.intermediate)
    qs, kvs, li = loc.q_size, loc.kv_size, loc.intermediate
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        yield Target(p + "input_layernorm.weight", (hid,), layer.attn_norm)
        yield Target(p + "post_attention_layernorm.weight", (hid,), layer.ffn_norm)
        parts = [("q_proj", s.q_size, 0, qs, q_rows), ("k_proj", s.kv_size, qs, kvs, kv_rows),
                 ("v_proj", s.kv_size, qs + kvs, kvs, kv_rows)]
        for proj, full, at, size, rows in parts:
            yield Target(f"{p}self_attn.{proj}.weight", (full, hid), layer.w_qkv[at:at + size],
                         rows=rows)
            if layer.b_qkv is not None:
                yield Target(f"{p}self_attn.{proj}.bias", (full,), layer.b_qkv[at:at + size],
                             rows=rows)
        yield Target(p + "self_attn.o_proj.weight", (hid, s.q_size), layer.w_o, cols=q_rows)
        if layer.router is None:
            yield from _ffn(p + "mlp.", ("gate_proj", "up_proj", "down_proj"), layer.w_gate_up,
                            layer.w_down, hid, s.intermediate_size, li, inter)
            continue
        moe = p + "block_sparse_moe."
        yield Target(moe + "gate.weight", (s.num_experts, hid), layer.router)
        for e in range(s.num_experts):
            yield from _ffn(f"{moe}experts.{e}.", ("w1", "w3", "w2"), layer.w_gate_up[e],
                            layer.w_down[e], hid, s.intermediate_size, li, inter)
    yield Target("model.norm.weight", (hid,), model.final_norm)
    if not s.tie_word_embeddings:
        yield Target("lm_head.weight", (s.vocab_size, hid), model.lm_head[:n_vocab], rows=vocab)


def _ffn(prefix: str, names: tuple[str, str, str], gate_up: torch.Tensor, down: torch.Tensor,
         hid: int, full: int, local: int, rows: tuple[int, int]) -> Iterator[Target]:
    gate, up, dn = names
    yield Target(f"{prefix}{gate}.weight", (full, hid), gate_up[:local], rows=rows)
    yield Target(f"{prefix}{up}.weight", (full, hid), gate_up[local:], rows=rows)
    yield Target(f"{prefix}{dn}.weight", (hid, full), down, cols=rows)


def _ignorable(name: str, model: CausalLM) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (
        name == "lm_head.weight" and model.spec.tie_word_embeddings)


@torch.no_grad()
def load_weights(model: CausalLM, source: SafetensorsFolder | StateDictSource,
                 where: str = "checkpoint") -> None:
    """Copy this rank's slice of every tensor of `source` into `model` (see module docstring)."""
    targets = list(_targets(model))
    available = source.names()
    missing = [t.name for t in targets if t.name not in available]
    if missing:
        raise ConfigError(f"{where}: missing tensor {missing[0]!r} for model "
                          f"{model.spec.name!r}" + (f" (and {len(missing) - 1} more)"
                                                    if len(missing) > 1 else ""))
    unexpected = sorted(available - {t.name for t in targets})
    unexpected = [n for n in unexpected if not _ignorable(n, model)]
    if unexpected:
        raise ConfigError(f"{where}: unexpected tensor {unexpected[0]!r} (not part of a "
                          f"{model.spec.arch} model with this config)"
                          + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""))
    for t in targets:
        found = source.shape(t.name)
        if found != t.shape:
            raise ConfigError(f"{where}: tensor {t.name!r} has shape {list(found)}, expected "
                              f"{list(t.shape)} from config.json")
        t.dest.copy_(source.read(t.name, t.rows, t.cols).to(t.dest.dtype))


def load_checkpoint(model: CausalLM, folder: str | Path) -> None:
    """Load the safetensors checkpoint in `folder` into `model` (this rank's shards)."""
    load_weights(model, SafetensorsFolder(folder), where=f"checkpoint {folder}")


def checkpoint_folder(model: str) -> Path | None:
    """The checkpoint folder `model` names, or None for a registered name or a folder without
    *.safetensors (random weights)."""
    if model in REGISTRY:
        return None
    path = Path(model)
    folder = path if path.is_dir() else path.parent
    return folder if any(folder.glob("*.safetensors")) else None


def model_folder(model: str) -> Path | None:
    """The folder `--model` points into (a folder, or a config.json's parent), if any."""
    path = Path(model)
    if path.is_dir():
        return path
    return path.parent if path.is_file() else None


def eos_ids(model: str) -> set[int]:
    """`eos_token_id` of the config.json beside the model (none for registered names)."""
    folder = model_folder(model)
    config = folder / "config.json" if folder else None
    if config is None or not config.is_file():
        return set()
    eos = json.loads(config.read_text()).get("eos_token_id")
    return set(eos) if isinstance(eos, list) else ({eos} if isinstance(eos, int) else set())
