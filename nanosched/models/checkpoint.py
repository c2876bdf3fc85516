"""Load an HF checkpoint (config.json + *.safetensors, optionally sharded with
model.safetensors.index.json) into a `CausalLM`, reading only this tp rank's slices.

Weights must be floating-point (an integer tensor where a weight belongs is refused by name)
and finite (a tensor holding NaN or infinities is named after it is read: served, it would
only ever sample errors). A device, FIFO or socket where a file is read is refused, not read.
Never goes through pickle: tensors are read with `safetensors.safe_open(...).get_slice`, so a
rank reads its rows/columns only. Every tensor the model needs must be present with its HF
shape, and every tensor in the checkpoint must be used (rotary `inv_freq` buffers and a tied
`lm_head.weight` are ignored); otherwise a ConfigError names the tensor and the shapes.

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from nanosched.errors import ConfigError
from nanosched.fileio import read_json, special_kind
from nanosched.models import fp8_checkpoint
from nanosched.models.model import CausalLM
from nanosched.models.quant import FP8_DTYPE, quantize_into
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
    scale: torch.Tensor | None = None  # an e4m3 dest's row scales (models/quant.py)


class SafetensorsFolder:
    """The tensors of a checkpoint folder, opened lazily, sliced on read."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        self._where: dict[str, object] = {}
        for path in checkpoint_files(self.folder):
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors' own error type: a damaged file
                raise ConfigError(f"checkpoint {path}: cannot be opened as safetensors "
                                  f"({exc})") from None
            self._where.update(dict.fromkeys(handle.keys(), handle))

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def is_float(self, name: str) -> tuple[bool, str]:
        dtype = self._where[name].get_slice(name).get_dtype()
        return dtype in FLOAT_DTYPES, dtype

    def read(self, name: str, rows: Range, cols: Range) -> torch.Tensor:
        if rows is None and cols is None:  # whole (a 0-d scale too, which a slice cannot be)
            return self._where[name].get_tensor(name)
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

    def is_float(self, name: str) -> tuple[bool, str]:
        dtype = self.tensors[name].dtype
        return dtype.is_floating_point, str(dtype).removeprefix("torch.")

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
        qkv_scale = _scale(layer, "w_qkv")
        for proj, full, at, size, rows in parts:
            yield Target(f"{p}self_attn.{proj}.weight", (full, hid), layer.w_qkv[at:at + size],
                         rows=rows, scale=_rows(qkv_scale, at, at + size))
            if layer.b_qkv is not None:
                yield Target(f"{p}self_attn.{proj}.bias", (full,), layer.b_qkv[at:at + size],
                             rows=rows)
        yield Target(p + "self_attn.o_proj.weight", (hid, s.q_size), layer.w_o, cols=q_rows,
                     scale=_scale(layer, "w_o"))
        if layer.router is None:
            yield from _ffn(p + "mlp.", ("gate_proj", "up_proj", "down_proj"), layer.w_gate_up,
                            layer.w_down, hid, s.intermediate_size, li, inter,
                            _scale(layer, "w_gate_up"), _scale(layer, "w_down"))
            continue
        moe = p + "block_sparse_moe."
        yield Target(moe + "gate.weight", (s.num_experts, hid), layer.router)
        gate_up_scale, down_scale = _scale(layer, "w_gate_up"), _scale(layer, "w_down")
        for e in range(s.num_experts):
            yield from _ffn(f"{moe}experts.{e}.", ("w1", "w3", "w2"), layer.w_gate_up[e],
                            layer.w_down[e], hid, s.intermediate_size, li, inter,
                            _expert(gate_up_scale, e), _expert(down_scale, e))
    yield Target("model.norm.weight", (hid,), model.final_norm)
    if not s.tie_word_embeddings:
        yield Target("lm_head.weight", (s.vocab_size, hid), model.lm_head[:n_vocab], rows=vocab)


def _ffn(prefix: str, names: tuple[str, str, str], gate_up: torch.Tensor, down: torch.Tensor,
         hid: int, full: int, local: int, rows: tuple[int, int],
         gate_up_scale: torch.Tensor | None = None,
         down_scale: torch.Tensor | None = None) -> Iterator[Target]:
    gate, up, dn = names
    yield Target(f"{prefix}{gate}.weight", (full, hid), gate_up[:local], rows=rows,
                 scale=_rows(gate_up_scale, 0, local))
    yield Target(f"{prefix}{up}.weight", (full, hid), gate_up[local:], rows=rows,
                 scale=_rows(gate_up_scale, local, 2 * local))
    yield Target(f"{prefix}{dn}.weight", (hid, full), down, cols=rows, scale=down_scale)


def _scale(layer: torch.nn.Module, weight: str) -> torch.Tensor | None:
    """The row scales of `layer`'s e4m3 weight `weight`, None for a model-dtype weight."""
    return getattr(layer, f"{weight}_scale") if layer.is_fp8(weight) else None


def _rows(scale: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    return None if scale is None else scale[start:end]


def _expert(scale: torch.Tensor | None, e: int) -> torch.Tensor | None:
    """Expert `e`'s row scales [N] of an e4m3 expert weight's [E, N] (None: model dtype)."""
    return None if scale is None else scale[e]


def _ignorable(name: str, model: CausalLM, weights: set[str]) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (
        name == "lm_head.weight" and model.spec.tie_word_embeddings) or \
        fp8_checkpoint.is_companion(name, weights)


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
    weights = {t.name for t in targets}
    unexpected = [n for n in unexpected if not _ignorable(n, model, weights)]
    if unexpected:
        raise ConfigError(f"{where}: unexpected tensor {unexpected[0]!r} (not part of a "
                          f"{model.spec.arch} model with this config)"
                          + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""))
    for t in targets:
        found = source.shape(t.name)
        if found != t.shape:
            raise ConfigError(f"{where}: tensor {t.name!r} has shape {list(found)}, expected "
                              f"{list(t.shape)} from config.json")
        is_float, dtype = source.is_float(t.name)
        if not is_float:
            raise ConfigError(f"{where}: tensor {t.name!r} holds {dtype}, not floating-point "
                              f"weights: the checkpoint is damaged or not this model's")
    for t in targets:
        value = source.read(t.name, t.rows, t.cols)
        if value.dtype == FP8_DTYPE:  # stored in e4m3: its slice with one scale per row
            value, scale = fp8_checkpoint.e4m3_rows(source, t.name, value, t.rows, t.cols)
            _check_finite(value.float(), t.name, where)
            if t.scale is not None:
                t.dest.copy_(value)
                t.scale.copy_(scale)
                continue
            value = value.float() * scale[:, None]  # where the model keeps its dtype
        if t.scale is not None:  # an e4m3 weight: this slice's rows quantised as they load
            _check_finite(value, t.name, where)
            quantize_into(value, t.dest, t.scale)
        else:
            t.dest.copy_(value.to(t.dest.dtype))
            _check_finite(t.dest, t.name, where)


def _check_finite(value: torch.Tensor, name: str, where: str) -> None:
    if not bool(torch.isfinite(value).all()):
        raise ConfigError(f"{where}: tensor {name!r} holds NaN or infinite values: the "
                          f"checkpoint is damaged (or was saved from a diverged run)")


def load_checkpoint(model: CausalLM, folder: str | Path) -> None:
    """Load the safetensors checkpoint in `folder` into `model` (this rank's shards)."""
    load_weights(model, SafetensorsFolder(folder), where=f"checkpoint {folder}")


INDEX = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt")
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def checkpoint_folder(model: str) -> Path | None:
    """The checkpoint folder `model` names, or None for a registered name or a folder without
    weights (random weights). A folder with an index or pickled weights but no safetensors is
    refused: serving random weights in their place would be a silent wrong answer."""
    if model in REGISTRY:
        return None
    path = Path(model)
    folder = path if path.is_dir() else path.parent
    if any(folder.glob("*.safetensors")) or (folder / INDEX).exists():
        return folder
    pickled = sorted(p.name for pattern in PICKLED for p in folder.glob(pattern))
    if pickled:
        raise ConfigError(f"checkpoint {folder}: holds {', '.join(pickled[:3])} but no "
                          f"*.safetensors; nanosched reads safetensors only (it never unpickles "
                          f"weights): convert the checkpoint to safetensors")
    return None


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of `folder` (the index's shards, else every *.safetensors), each
    checked: inside the folder, present, and with a header that parses and fits the file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"checkpoint {folder}: not a folder")
    index = folder / INDEX
    if index.exists():
        files = [_shard(folder, name, index) for name in _weight_map_files(index)]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"checkpoint {folder}: no *.safetensors files")
    for f in files:
        if f.is_dir():
            raise ConfigError(f"checkpoint {f}: is a folder, not a safetensors file")
        check_regular(f, "checkpoint")
        check_safetensors_header(f)
    return files


def check_regular(path: Path, what: str) -> None:
    """Refuse a device, FIFO or socket where a file is read: reading a FIFO waits for a
    writer forever."""
    kind = special_kind(path)
    if kind is not None:
        raise ConfigError(f"{what} {path}: is {kind}, not a regular file")


def _weight_map_files(index: Path) -> list[str]:
    data = read_json(index, "checkpoint index", ConfigError)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"checkpoint index {index}: field 'weight_map' must be a non-empty "
                          f"object of tensor name -> file")
    bad = [v for v in weight_map.values() if not isinstance(v, str) or not v]
    if bad:
        raise ConfigError(f"checkpoint index {index}: field 'weight_map' has file {bad[0]!r}; "
                          f"files are non-empty strings")
    return sorted(set(weight_map.values()))


def _shard(folder: Path, name: str, index: Path) -> Path:
    path = folder / name
    root = folder.resolve()
    if Path(name).is_absolute() or not path.resolve().is_relative_to(root):
        raise ConfigError(f"checkpoint index {index}: field 'weight_map' names {name!r}, "
                          f"outside the checkpoint folder; refused")
    check_regular(path, "checkpoint")
    if not path.is_file():
        raise ConfigError(f"checkpoint index {index}: field 'weight_map' names missing file "
                          f"{name!r}")
    return path


def check_safetensors_header(path: Path) -> None:
    """Refuse a file whose safetensors header (8-byte length, then JSON: per tensor dtype,
    shape and data offsets) does not parse or points past the end of the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"checkpoint {path}: not a safetensors file, or truncated "
                              f"({size} bytes)")
        n = int.from_bytes(head, "little")
        if not 2 <= n <= min(size - 8, MAX_HEADER_BYTES):
            raise ConfigError(f"checkpoint {path}: not a safetensors file, or truncated "
                              f"(header of {n} bytes in a file of {size})")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, a 4,300-digit integer
        raise ConfigError(f"checkpoint {path}: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ConfigError(f"checkpoint {path}: safetensors header is not a JSON object")
    data_bytes = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        why = _tensor_problem(info, data_bytes)
        if why:
            raise ConfigError(f"checkpoint {path}: tensor {name!r}: {why}")


def _tensor_problem(info: object, data_bytes: int) -> str | None:
    if not isinstance(info, dict):
        return "header entry is not an object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        return f"dtype {dtype!r} is not a safetensors dtype"
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return f"shape {shape!r} is not a list of sizes"
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        return f"data_offsets {offsets!r} is not [start, end]"
    start, end = offsets
    if not 0 <= start <= end <= data_bytes:
        return (f"data [{start}, {end}) past the end of the file's {data_bytes} data bytes "
                f"(truncated?)")
    if end - start != math.prod(shape) * DTYPE_BYTES[dtype]:
        return f"{end - start} bytes for shape {shape} of {dtype}"
    return None


def load_tokenizer(folder: Path) -> object:
    """The folder's tokenizer through transformers' AutoTokenizer; a file it cannot read
    (garbage tokenizer.json, a bad tokenizer_config.json) is a ConfigError naming the folder."""
    from transformers import AutoTokenizer

    for p in sorted(folder.iterdir()):  # transformers opens whatever it looks for
        if p.suffix in WEIGHT_SUFFIXES or p.name == INDEX:
            continue  # weights: checked as the checkpoint's (`checkpoint_files`), not read here
        if p.is_dir():
            if p.name in TOKENIZER_FILES or p.suffix in (".json", ".txt", ".model"):
                raise ConfigError(f"tokenizer file {p}: is a folder, not a file")
            continue
        check_regular(p, "tokenizer file")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # transformers and tokenizers raise many types on a bad file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"tokenizer in {folder}: cannot be loaded ({first[:200]})") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def model_tokenizer(model: str) -> object | None:
    """The tokenizer of `--model`: its folder's, when the folder holds tokenizer files; else
    the one shipped for a registered name (`models.tokenizers`: stories15m); else None."""
    from nanosched.models.tokenizers import has_shipped_tokenizer, shipped_tokenizer

    folder = model_folder(model)
    if folder is not None and any((folder / f).exists() for f in TOKENIZER_FILES):
        return load_tokenizer(folder)
    if folder is None and has_shipped_tokenizer(model):
        try:
            return shipped_tokenizer(model)
        except ImportError:  # no transformers (the serve extra): token ids only
            return None
    return None


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
    data = read_json(config, "config", ConfigError)
    eos = data.get("eos_token_id") if isinstance(data, dict) else None
    ids = eos if isinstance(eos, list) else [eos]
    return {i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0}
