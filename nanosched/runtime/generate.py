"""Text generation through the paged KV cache: the library behind `nanosched generate`.

`generate(GenerateConfig(...))` builds the model (an HF checkpoint folder, or random weights
for a registered name), prefills the prompt in one batch, then decodes one token per step with
greedy (temperature 0) or temperature sampling, stopping at EOS or `max_tokens`. With tp > 1 it
runs one process per rank (gloo on CPU, NCCL on CUDA) and returns rank 0's result.
`step(model, ws, chunks)` runs one batch of several requests and is what the tests use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanosched.constants import PAGE_SIZE
from nanosched.errors import ConfigError
from nanosched.kernels.common import cuda_available
from nanosched.kernels.dispatch import KernelOptions
from nanosched.models.checkpoint import checkpoint_folder, eos_ids
from nanosched.models.model import CausalLM
from nanosched.models.parallel import TensorParallel, launch
from nanosched.models.spec import ModelSpec, load_spec
from nanosched.models.workspace import Workspace
from nanosched.runtime.loader import load_model, resolve_device, resolve_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class GenerateConfig:
    """What `nanosched generate` was asked for."""

    model: str
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    max_tokens: int = 32
    temperature: float = 0.0
    device: str = "cpu"
    tp: int = 1
    seed: int = 0
    kernels: KernelOptions = field(default_factory=KernelOptions)


@dataclass(frozen=True)
class GenerateResult:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str | None  # the decoded continuation when the checkpoint has a tokenizer
    random_weights: bool




def step(model: CausalLM, ws: Workspace,
         chunks: list[tuple[int, list[int], bool]]) -> torch.Tensor:
    """Run one batch; chunks are (request id, new token ids, is_decode), decode first.

    Returns the fp32 logits [len(chunks), V] at each chunk's last token.
    """
    meta = ws.kv.plan([(req, len(ids), is_decode) for req, ids, is_decode in chunks])
    flat = [t for _, ids, _ in chunks for t in ids]
    ws.token_ids[: len(flat)].copy_(torch.tensor(flat, dtype=torch.int64))
    rows = torch.tensor(meta.seg_ends, dtype=torch.int64, device=model.device) - 1
    with torch.inference_mode():
        return model(ws, meta, rows).float()


def _sample(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.cpu() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def _run_rank(tp: TensorParallel, cfg: GenerateConfig, prompt: list[int]) -> GenerateResult:
    weights = resolve_weights(cfg.model, None)
    model = load_model(load_spec(cfg.model), weights, resolve_device(cfg.device, tp.rank),
                       cfg.seed, tp, cfg.kernels)
    is_random = weights == "random"
    total = len(prompt) + cfg.max_tokens
    ws = model.new_workspace(max_tokens=len(prompt), num_pages=-(-total // PAGE_SIZE) + 1)
    gen = torch.Generator().manual_seed(cfg.seed)
    eos, out = eos_ids(cfg.model), []
    logits = step(model, ws, [(0, prompt, False)])[0]
    while len(out) < cfg.max_tokens:
        out.append(_sample(logits, cfg.temperature, gen))
        if out[-1] in eos or len(out) == cfg.max_tokens:
            break
        logits = step(model, ws, [(0, [out[-1]], True)])[0]
    return GenerateResult(prompt, out, None, is_random)


def _tokenizer(cfg: GenerateConfig):  # -> transformers tokenizer or None
    folder = checkpoint_folder(cfg.model)
    if folder is None or not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _check(cfg: GenerateConfig, spec: ModelSpec, prompt: list[int]) -> None:
    spec.check_tp(cfg.tp)
    if cfg.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {cfg.max_tokens}")
    if cfg.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {cfg.temperature}")
    if cfg.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, got {cfg.device!r}")
    if cfg.device == "cuda" and not cuda_available():
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
    spec = load_spec(cfg.model)
    if (cfg.prompt is None) == (cfg.prompt_ids is None):
        raise ConfigError("give exactly one of --prompt TEXT and --prompt-ids 1,2,3")
    tok = _tokenizer(cfg)
    if cfg.prompt is not None and tok is None:
        raise ConfigError(f"--prompt needs a tokenizer; --model {cfg.model} has none "
                          f"(use --prompt-ids)")
    prompt = list(cfg.prompt_ids) if cfg.prompt is None else tok(cfg.prompt)["input_ids"]
    _check(cfg, spec, prompt)
    if cfg.tp == 1:
        res = _run_rank(TensorParallel(), cfg, prompt)
    else:
        res = launch(_run_rank, cfg.tp, "nccl" if cfg.device == "cuda" else "gloo", cfg, prompt)
    text = tok.decode(res.output_ids, skip_special_tokens=True) if tok is not None else None
    return GenerateResult(res.prompt_ids, res.output_ids, text, res.random_weights)
