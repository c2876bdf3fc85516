"""Text generation through the engine: the library behind `nanosched generate`.

`generate(GenerateConfig(...))` loads the engine with `runtime.loader.load_engine` (the model
of an HF checkpoint folder, or random weights for a registered name; Sequential, eager) and
serves the prompt as one request: the prompt is prefilled in one batch (the dense batch is the
prompt's length unless set), then one token is decoded per step, greedy (temperature 0) or
sampled by the engine's sampler, until EOS or `max_tokens`. With tp > 1 the same engine runs
on tp ranks, this process scheduling and sampling as rank 0 (runtime/ranks/group.py: NCCL on
CUDA, gloo on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from nanosched.errors import ConfigError
from nanosched.kernels.common import cuda_available
from nanosched.models.checkpoint import model_tokenizer
from nanosched.models.spec import ModelSpec, load_spec
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.loader import load_engine, resolve_weights
from nanosched.runtime.requests import Request, SamplingParams


@dataclass(frozen=True)
class GenerateConfig:
    """What `nanosched generate` was asked for: the engine (`engine.model` is required) and the
    prompt (text through the checkpoint's tokenizer, or token ids) with its sampling."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(device="cpu"))
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    max_tokens: int = 32
    temperature: float = 0.0


@dataclass(frozen=True)
class GenerateResult:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str | None  # the decoded continuation when the checkpoint has a tokenizer
    random_weights: bool


def _serve_one(cfg: GenerateConfig, prompt: list[int]) -> list[int]:
    req = Request(0, list(prompt), SamplingParams(temperature=cfg.temperature,
                                                   max_tokens=cfg.max_tokens))
    engine_cfg = replace(cfg.engine, dense_batch=cfg.engine.dense_batch or len(prompt))
    with load_engine(engine_cfg, requests=[req]) as loaded, torch.inference_mode():
        loaded.engine.add_request(req)
        loaded.engine.run_to_completion()
    if req.finish_reason == "error":
        raise ConfigError(f"the model's logits are not finite (NaN or infinite) after "
                          f"{len(req.output_ids)} generated tokens: its weights or activations "
                          f"overflow; check the checkpoint (or run it in fp32 on the CPU)")
    return req.output_ids


def _check(cfg: GenerateConfig, spec: ModelSpec, prompt: list[int]) -> None:
    eng = cfg.engine
    spec.check_tp(eng.tp)
    if cfg.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {cfg.max_tokens}")
    if not 0 <= cfg.temperature < float("inf"):
        raise ConfigError(f"--temperature must be a finite number >= 0 (0: greedy), got "
                          f"{cfg.temperature}")
    if eng.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, got {eng.device!r}")
    if eng.device == "cuda" and not cuda_available():
        raise ConfigError("--device cuda: no CUDA device is visible to torch")
    if not prompt:
        raise ConfigError("the prompt is empty")
    bad = [t for t in prompt if not 0 <= t < spec.vocab_size]
    if bad:
        raise ConfigError(f"--prompt-ids: token {bad[0]} is outside the vocabulary "
                          f"0..{spec.vocab_size - 1}")
    if len(prompt) + cfg.max_tokens > spec.max_position_embeddings:
        raise ConfigError(f"prompt ({len(prompt)} tokens) + --max-tokens {cfg.max_tokens} "
                          f"exceeds the model's {spec.max_position_embeddings} positions")


def generate(cfg: GenerateConfig) -> GenerateResult:
    """Generate a continuation of the prompt (see module docstring)."""
    model = cfg.engine.model
    if model is None:
        raise ConfigError("--model is required")
    spec = load_spec(model)
    if (cfg.prompt is None) == (cfg.prompt_ids is None):
        raise ConfigError("give exactly one of --prompt TEXT and --prompt-ids 1,2,3")
    tok = model_tokenizer(model)
    if cfg.prompt is not None and tok is None:
        raise ConfigError(f"--prompt needs a tokenizer; --model {model} has none "
                          f"(use --prompt-ids)")
    prompt = list(cfg.prompt_ids) if cfg.prompt is None else tok(cfg.prompt)["input_ids"]
    _check(cfg, spec, prompt)
    out = _serve_one(cfg, prompt)
    text = tok.decode(out, skip_special_tokens=True) if tok is not None else None
    return GenerateResult(prompt, out, text,
                          resolve_weights(model, cfg.engine.weights) == "random")
