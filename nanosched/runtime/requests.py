"""Requests and the workloads that produce them.

A `Request` is what the engine serves: prompt token ids, how many tokens to generate at most,
sampling settings and (for benchmarks) an arrival time. `make_requests` builds them from
- fixed lengths (`--input-len IN --output-len OUT`, vLLM's names),
- a named dataset of NanoFlow's Table 4 (`splitwise`, `lmsys`, `sharegpt`): seeded lengths drawn
  from log-normal distributions with the table's mean and standard deviation,
- a JSONL file, one request per line: `{"prompt_len": N | "prompt_ids": [...], "output_len": M}`,
- prompts that share prefixes (`shared-prefix:...`, `multi-turn:...`: runtime/traces.py),
and `poisson_arrivals` spaces them at a request rate (exponential gaps, NanoFlow §6.3).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nanosched.errors import ConfigError
from nanosched.workloads import DATASETS, Workload, fixed


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False  # benchmark mode: generate exactly max_tokens
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:
            raise ConfigError(f"temperature must be a finite number >= 0, got "
                              f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")


@dataclass
class Request:
    """One generation request and its progress (mutated only by the engine)."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival_s: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    pending: int = 0  # tokens sampled on the device but not yet read back (async loop)
    num_prefilled: int = 0  # tokens of the prefill (see `prefill_len`) already in the KV cache
    num_recompute: int = 0  # output tokens prefilled again after a recompute preemption
    # prefix caching: hashes of the full pages of prompt + outputs computed so far
    # (models/prefix.py), and how many of its block table's pages are in the cache's index
    page_hashes: list[int] = field(default_factory=list, repr=False)
    num_cached_pages: int = 0
    finished: bool = False
    finish_reason: str = ""
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        """Tokens generated so far, counting those still on the device."""
        return len(self.output_ids) + self.pending

    @property
    def prefill_len(self) -> int:
        """Tokens to prefill before decoding: the prompt, then the outputs whose KV a recompute
        preemption dropped (their last position samples the next, new, token)."""
        return self.prompt_len + self.num_recompute

    def prefill_ids(self, start: int, num_tokens: int) -> list[int]:
        """Token ids of prefill positions [start, start + num_tokens): prompt, then outputs."""
        end = start + num_tokens
        if end <= self.prompt_len:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def is_prefilling(self) -> bool:
        return self.num_prefilled < self.prefill_len

    @property
    def peak_tokens(self) -> int:
        """KV tokens this request holds at its longest: prompt + every generated token."""
        return self.prompt_len + self.params.max_tokens


def _lognormal_lengths(rng: np.random.Generator, mean: float, std: float, n: int,
                       max_len: int) -> list[int]:
    if std <= 0:
        return [max(1, min(max_len, round(mean)))] * n
    sigma2 = math.log(1 + (std / mean) ** 2)
    mu = math.log(mean) - sigma2 / 2
    draws = rng.lognormal(mu, math.sqrt(sigma2), size=n)
    return [int(x) for x in np.clip(np.round(draws), 1, max_len)]


def _random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return [int(x) for x in rng.integers(0, vocab_size, size=n)]


def synthetic_requests(workload: Workload, num_prompts: int, vocab_size: int, max_len: int,
                       seed: int = 0, ignore_eos: bool = True) -> list[Request]:
    """Seeded requests whose lengths follow `workload` (fixed when its std is 0).

    Prompt plus output never exceeds `max_len` (the model's context): outputs are cut to fit.
    """
    if num_prompts < 1:
        raise ConfigError(f"--num-prompts must be a positive integer, got {num_prompts}")
    rng = np.random.default_rng(seed)
    ins = _lognormal_lengths(rng, workload.input_len, workload.input_std, num_prompts,
                             max_len - 1)
    outs = _lognormal_lengths(rng, workload.output_len, workload.output_std, num_prompts,
                              max_len - 1)
    return [
        Request(i, _random_ids(rng, p, vocab_size),
                SamplingParams(max_tokens=max(1, min(o, max_len - p)), ignore_eos=ignore_eos))
        for i, (p, o) in enumerate(zip(ins, outs, strict=True))
    ]


JSONL_FIELDS = ("prompt_len", "prompt_ids", "output_len")


def jsonl_requests(path: str | Path, vocab_size: int, max_len: int, seed: int = 0,
                   ignore_eos: bool = True) -> list[Request]:
    """Requests from a JSONL file; every error names the file, the line and the field.

    Refused: bytes that are not UTF-8 (naming the line they are on), a line that is not one
    JSON object (or nests too deep to parse), an unknown field, token ids that are not integers
    (booleans included) of the vocabulary, lengths that are not positive integers or exceed the
    model's context (checked before any token is drawn, so `prompt_len: 10**12` costs nothing).
    """
    from nanosched.fileio import special_kind

    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--workload {path}: is a folder, not a JSONL file")
    kind = special_kind(p)
    if kind is not None:
        raise ConfigError(f"--workload {path}: is {kind}, not a regular file")
    if not p.is_file():
        raise ConfigError(f"--workload {path}: no such file (and not one of "
                          f"{', '.join(DATASETS)})")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--workload {p}: cannot be read ({exc.strerror or exc})") from None
    rng = np.random.default_rng(seed)
    requests: list[Request] = []
    lines = raw.split(b"\n")
    if lines and not lines[-1].strip():
        lines.pop()  # the newline that ends the last line
    for n, data in enumerate(lines, start=1):
        where = f"{p}:{n}"
        obj = _jsonl_object(data, where)
        unknown = sorted(set(obj) - set(JSONL_FIELDS))
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown}; a request has "
                              f"{', '.join(JSONL_FIELDS)}")
        out = obj.get("output_len")
        if not isinstance(out, int) or isinstance(out, bool) or out < 1:
            raise ConfigError(f"{where}: output_len must be a positive integer, got {out!r}")
        ids = _prompt_ids(obj, where, rng, vocab_size, max_len - out)
        requests.append(Request(len(requests), ids,
                                SamplingParams(max_tokens=out, ignore_eos=ignore_eos)))
    if not requests:
        raise ConfigError(f"{p}: file has no requests")
    return requests


def _jsonl_object(data: bytes, where: str) -> dict:
    try:
        line = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text (byte {exc.start} of the line)") from None
    if not line.strip():
        raise ConfigError(f"{where}: empty line; each line must be one JSON request")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested too deep") from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise ConfigError(f"{where}: a number too long to read ({exc})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected an object with prompt_len or prompt_ids")
    return obj


def _prompt_ids(obj: dict, where: str, rng: np.random.Generator, vocab_size: int,
                room: int) -> list[int]:
    """The prompt's ids (given, or `prompt_len` random ones); at most `room` tokens fit."""
    if "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not ids:
            raise ConfigError(f"{where}: prompt_ids must be a non-empty list of token ids")
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise ConfigError(f"{where}: prompt_ids[{i}] is {t!r}; token ids are integers "
                                  f"in 0..{vocab_size - 1}")
        n = len(ids)
    else:
        n = obj.get("prompt_len")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"{where}: prompt_len must be a positive integer (or give "
                              f"prompt_ids), got {n!r}")
    if n > room:
        raise ConfigError(f"{where}: prompt ({n}) + output_len ({obj['output_len']}) exceeds "
                          f"the model's context of {room + obj['output_len']} tokens")
    return ids if "prompt_ids" in obj else _random_ids(rng, n, vocab_size)


MAX_ARRIVAL_SPAN_S = 86_400.0  # a benchmark's requests arrive within a day


def check_request_rate(rate: float, num_prompts: int) -> None:
    """Refuse a rate that is not positive, or so low that `num_prompts` requests would take
    more than MAX_ARRIVAL_SPAN_S to arrive (the run would wait for them)."""
    if not rate > 0:
        raise ConfigError(f"--request-rate must be positive (inf: all at once), got {rate}")
    span = num_prompts / rate
    if span > MAX_ARRIVAL_SPAN_S:
        raise ConfigError(f"--request-rate {rate:g}: {num_prompts} requests would arrive over "
                          f"about {span:.3g} s; give at least "
                          f"{num_prompts / MAX_ARRIVAL_SPAN_S:.3g} requests/s (all within a "
                          f"day), or inf for all at once")


def poisson_arrivals(requests: list[Request], rate: float, seed: int = 0) -> None:
    """Set arrival times with exponential gaps at `rate` requests/s (inf: all at time 0)."""
    check_request_rate(rate, len(requests))
    if math.isinf(rate):
        return
    gaps = np.random.default_rng(seed + 1).exponential(1 / rate, size=len(requests))
    for r, t in zip(requests, np.cumsum(gaps), strict=True):
        r.arrival_s = float(t)


def make_requests(workload: str | None, input_len: int | None, output_len: int | None,
                  num_prompts: int, vocab_size: int, max_len: int, seed: int = 0,
                  ignore_eos: bool = True) -> list[Request]:
    """Requests from the bench flags: a dataset name, a JSONL path, or fixed lengths."""
    if workload is not None and (input_len is not None or output_len is not None):
        raise ConfigError("give either --workload or --input-len/--output-len, not both")
    if workload is None:
        if input_len is None or output_len is None:
            raise ConfigError("give --input-len and --output-len, or --workload")
        if input_len + output_len > max_len:
            raise ConfigError(f"--input-len {input_len} + --output-len {output_len} exceeds "
                              f"the model's context of {max_len} tokens")
        return synthetic_requests(fixed(input_len, output_len), num_prompts, vocab_size,
                                  max_len, seed, ignore_eos)
    from nanosched.runtime.traces import is_trace, trace_requests

    if is_trace(workload):
        return trace_requests(workload, num_prompts, vocab_size, max_len, seed, ignore_eos)
    if workload in DATASETS:
        return synthetic_requests(DATASETS[workload], num_prompts, vocab_size, max_len, seed,
                                  ignore_eos)
    return jsonl_requests(workload, vocab_size, max_len, seed, ignore_eos)[:num_prompts]
