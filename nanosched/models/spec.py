"""Model specs: the numbers of a decoder-only transformer that cost model, search and runtime use.

A `ModelSpec` is a frozen dataclass. Named specs live in `REGISTRY` (gpt-fast's
`transformer_configs` pattern); `load_spec(name_or_path)` also reads a Hugging Face
`config.json`, or a checkpoint folder holding one.

Legend for shape comments elsewhere: D = hidden size, Hq/Hkv = query/KV heads, d = head dim,
I = intermediate size, V = vocabulary, E = experts, k = experts per token, L = layers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nanosched.errors import ConfigError
from nanosched.fileio import check_fields, read_json

# Upper bounds of a spec's sizes: well above every released model, far below what would make
# a table or a cache of that size exhaust memory before anything says why.
SPEC_BOUNDS = {
    "hidden_size": 1 << 17, "num_layers": 1024, "num_heads": 1024, "num_kv_heads": 1024,
    "head_dim": 1024, "intermediate_size": 1 << 20, "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 24,
}

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama-family (optionally MoE) decoder-only model."""

    name: str
    arch: str  # "llama" | "qwen2" | "mixtral"
    hidden_size: int  # D
    num_layers: int  # L
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # d
    intermediate_size: int  # I (per expert for MoE)
    vocab_size: int  # V
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    num_experts: int = 0  # E; 0 means a dense FFN
    num_experts_per_tok: int = 0  # k
    rope_scaling: dict[str, Any] | None = field(default=None, compare=False)
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        """Refuse a spec no model can have: every size a positive integer within SPEC_BOUNDS
        (a hand-written config.json with max_position_embeddings 10^18 would otherwise size
        rotary tables and KV caches from it), finite positive rope_theta and rms_norm_eps."""
        for name, most in SPEC_BOUNDS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model {self.name!r}: {name} must be a positive integer, "
                                  f"got {value!r}")
            if value > most:
                raise ConfigError(f"model {self.name!r}: {name} {value} is above {most:,}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not 0 < value < math.inf):
                raise ConfigError(f"model {self.name!r}: {name} must be a finite positive "
                                  f"number, got {value!r}")
        for name in ("num_experts", "num_experts_per_tok"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 1024:
                raise ConfigError(f"model {self.name!r}: {name} must be an integer in 0..1024, "
                                  f"got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"model {self.name!r}: num_experts_per_tok "
                              f"{self.num_experts_per_tok} is above num_experts "
                              f"{self.num_experts}")
        if self.dtype_bytes not in (1, 2, 4) or isinstance(self.dtype_bytes, bool):
            raise ConfigError(f"model {self.name!r}: dtype_bytes must be 1, 2 or 4, got "
                              f"{self.dtype_bytes!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ConfigError(f"model {self.name!r}: rope_scaling must be an object or null, "
                              f"got {self.rope_scaling!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model {self.name!r}: num_heads ({self.num_heads}) must be a "
                              f"multiple of num_kv_heads ({self.num_kv_heads})")
        if self.arch not in set(ARCHITECTURES.values()):
            raise ConfigError(f"model {self.name!r}: arch must be one of "
                              f"{sorted(set(ARCHITECTURES.values()))}, got {self.arch!r}")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"model {self.name!r}: num_experts_per_tok must be in "
                              f"1..{self.num_experts}, got {self.num_experts_per_tok}")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def attn_params_per_layer(self) -> int:
        qkv = self.hidden_size * (self.q_size + 2 * self.kv_size)
        bias = (self.q_size + 2 * self.kv_size) if self.qkv_bias else 0
        return qkv + bias + self.q_size * self.hidden_size

    def ffn_params_per_layer(self, active: bool = False) -> int:
        one = 3 * self.hidden_size * self.intermediate_size  # gate, up, down
        if not self.is_moe:
            return one
        experts = self.num_experts_per_tok if active else self.num_experts
        return experts * one + self.hidden_size * self.num_experts  # + router

    def params_per_layer(self, active: bool = False) -> int:
        norms = 2 * self.hidden_size
        return self.attn_params_per_layer() + self.ffn_params_per_layer(active) + norms

    @property
    def num_embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def num_params(self, active: bool = False) -> int:
        """All parameters (embeddings, layers, final norm, LM head unless tied).

        With `active=True`, a MoE model counts only the experts a token uses (k of E).
        """
        layers = self.num_layers * self.params_per_layer(active)
        return self.num_embedding_params + layers + self.hidden_size + self.num_lm_head_params

    def kv_bytes_per_token(self, tp: int = 1, kv_dtype: str = "auto",
                           dtype_bytes: int | None = None) -> int:
        """Bytes of K and V one token keeps in the cache, all layers, on one of `tp` GPUs:
        `dtype_bytes` per value (default the spec's), or for an FP8 cache one byte per value
        plus a 4-byte scale per (token, KV head) (models/kvcache.py)."""
        kv_heads = max(1, self.num_kv_heads // tp)
        if kv_dtype == "fp8":
            return 2 * kv_heads * (self.head_dim + 4) * self.num_layers
        return 2 * kv_heads * self.head_dim * (dtype_bytes or self.dtype_bytes) * self.num_layers

    def check_tp(self, tp: int) -> None:
        """Raise ConfigError unless the model can be sharded `tp` ways."""
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"--tp must be a positive integer, got {tp!r}")
        allowed = [n for n in range(1, self.num_heads + 1) if self.tp_ok(n)]
        if not self.tp_ok(tp):
            raise ConfigError(
                f"--tp {tp} does not divide model {self.name!r} (num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, intermediate_size={self.intermediate_size}); "
                f"allowed: {', '.join(map(str, allowed))}")

    def tp_ok(self, tp: int) -> bool:
        """Whether heads, KV heads (split or replicated) and the FFN divide `tp` ways."""
        kv_ok = self.num_kv_heads % tp == 0 or tp % self.num_kv_heads == 0
        return self.num_heads % tp == 0 and kv_ok and self.intermediate_size % tp == 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: str = "model spec") -> ModelSpec:
        """Build from `to_json`'s object; ConfigError names `where` and the field."""
        check_fields(cls, data, where, ConfigError)
        try:
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def _llama(name: str, **kw: Any) -> ModelSpec:
    return ModelSpec(name=name, arch=kw.pop("arch", "llama"), **kw)


REGISTRY: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        _llama("llama2-70b", hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
               head_dim=128, intermediate_size=28672, vocab_size=32000,
               max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5),
        _llama("llama3-8b", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
               head_dim=128, intermediate_size=14336, vocab_size=128256,
               max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5),
        _llama("llama3-70b", hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
               head_dim=128, intermediate_size=28672, vocab_size=128256,
               max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5),
        _llama("qwen2.5-72b", arch="qwen2", hidden_size=8192, num_layers=80, num_heads=64,
               num_kv_heads=8, head_dim=128, intermediate_size=29568, vocab_size=152064,
               max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
               qkv_bias=True),
        _llama("deepseek-67b", hidden_size=8192, num_layers=95, num_heads=64, num_kv_heads=8,
               head_dim=128, intermediate_size=22016, vocab_size=102400,
               max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6),
        # small real configs: random weights run in seconds on a CPU. stories15m is llama2.c's
        # TinyStories Llama (15 M parameters, 256 positions): the quick start's first minute
        _llama("stories15m", hidden_size=288, num_layers=6, num_heads=6, num_kv_heads=6,
               head_dim=48, intermediate_size=768, vocab_size=32000,
               max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True),
        _llama("smollm2-135m", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
               head_dim=64, intermediate_size=1536, vocab_size=49152,
               max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True),
        _llama("qwen2.5-0.5b", arch="qwen2", hidden_size=896, num_layers=24, num_heads=14,
               num_kv_heads=2, head_dim=64, intermediate_size=4864, vocab_size=151936,
               max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
               qkv_bias=True, tie_word_embeddings=True),
        _llama("mixtral-8x7b", arch="mixtral", hidden_size=4096, num_layers=32, num_heads=32,
               num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=32000,
               max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
               num_experts=8, num_experts_per_tok=2),
    ]
}


def _require(cfg: dict[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise ConfigError(f"{where}: missing field {key!r}")
    return cfg[key]


def _number(cfg: dict[str, Any], key: str, default: float, where: str) -> float:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{where}: field {key!r} must be a finite number, got {value!r}")
    return float(value)


def _flag(cfg: dict[str, Any], key: str, where: str) -> bool:
    value = cfg.get(key, False)
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{where}: field {key!r} must be true or false, got {value!r}")
    return bool(value)


def spec_from_hf_config(cfg: dict[str, Any], name: str, where: str = "config.json") -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config dict (Llama, Mistral, Qwen2, Mixtral).

    Every field is type-checked and bounded (`ModelSpec.__post_init__`); the error names the
    file and the field."""
    try:
        return _spec_from_hf_config(cfg, name, where)
    except ConfigError as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith(where) else f"{where}: {msg}") from None


def _spec_from_hf_config(cfg: dict[str, Any], name: str, where: str) -> ModelSpec:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    known = [a for a in archs if isinstance(a, str) and a in ARCHITECTURES]
    if not known:
        raise ConfigError(f"{where}: field 'architectures' is {archs!r}; supported: "
                          f"{', '.join(sorted(ARCHITECTURES))}")
    arch = ARCHITECTURES[known[0]]
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: field 'hidden_act' is {act!r}; only 'silu' is supported")
    hidden = _require(cfg, "hidden_size", where)
    heads = _require(cfg, "num_attention_heads", where)
    head_dim = cfg.get("head_dim") or (hidden // heads if isinstance(hidden, int) and
                                       isinstance(heads, int) and heads > 0 else 0)
    moe = arch == "mixtral"
    theta, scaling = _rope_fields(cfg, where)
    return ModelSpec(
        name=name,
        arch=arch,
        hidden_size=hidden,
        num_layers=_require(cfg, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=_require(cfg, "intermediate_size", where),
        vocab_size=_require(cfg, "vocab_size", where),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rope_theta=theta,
        rms_norm_eps=_number(cfg, "rms_norm_eps", 1e-6, where),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", where),
        qkv_bias=arch == "qwen2" or _flag(cfg, "attention_bias", where),
        num_experts=_require(cfg, "num_local_experts", where) if moe else 0,
        num_experts_per_tok=_require(cfg, "num_experts_per_tok", where) if moe else 0,
        rope_scaling=scaling,
    )


def _rope_fields(cfg: dict[str, Any], where: str = "config.json"
                 ) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope scaling) from either transformers-4 or transformers-5 config fields.

    transformers 5 writes `rope_parameters = {"rope_theta": ..., "rope_type": ...}`; older
    configs have top-level `rope_theta` and an optional `rope_scaling` dict. A scaling dict is
    kept only when its type is not "default".
    """
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (params if isinstance(params, dict) else {})
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"{where}: fields 'rope_parameters' and 'rope_scaling' must be objects")
    theta = _number(params, "rope_theta", _number(cfg, "rope_theta", 10000.0, where), where)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    return theta, (dict(scaling) if kind != "default" else None)


def load_spec(name_or_path: str) -> ModelSpec:
    """A registered name, an HF `config.json`, or a folder that holds one."""
    if name_or_path in REGISTRY:
        return REGISTRY[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"--model {name_or_path}: folder has no config.json")
    if path.suffix == ".json" and path.is_file():
        cfg = read_json(path, "--model", ConfigError)
        if not isinstance(cfg, dict):
            raise ConfigError(f"--model {path}: expected a JSON object")
        name = path.parent.name if path.name == "config.json" else path.stem
        return spec_from_hf_config(cfg, name=name, where=str(path))
    raise ConfigError(f"--model {name_or_path!r} is neither a known model nor a config.json or "
                      f"checkpoint folder; known models: {', '.join(sorted(REGISTRY))}")


def registry_rows(gpu_name: str) -> list[dict[str, Any]]:
    """One row per registered model: parameters, weight memory at bf16 and fp32, KV bytes per
    token, and the smallest tp whose GPUs of `gpu_name` hold the weights and the KV cache of a
    1,024-token dense batch at 1024 / 512 (None when none up to 64 does)."""
    from nanosched.hardware import get_gpu
    from nanosched.models.costmodel import choose_tp
    from nanosched.workloads import fixed

    gpu = get_gpu(gpu_name)
    rows = []
    for spec in REGISTRY.values():
        try:
            tp: int | None = choose_tp(spec, gpu, fixed(1024, 512), dense_batch=1024)
        except ConfigError:
            tp = None
        params = spec.num_params()
        rows.append({"name": spec.name, "arch": spec.arch, "params_b": params / 1e9,
                     "bf16_gib": 2 * params / 2**30, "fp32_gib": 4 * params / 2**30,
                     "kv_kib_per_token": spec.kv_bytes_per_token() / 1024, "tp": tp})
    return rows
