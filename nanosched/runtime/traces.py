"""Workloads whose prompts share prefixes (`bench --workload NAME:KEY=VALUE,...`), seeded.

- `shared-prefix:groups=G,prefix=P,unique=U,output=O`: G groups, each with its own P random
  tokens; request i belongs to group i mod G, its prompt that prefix then U tokens of its own,
  O output tokens.
- `multi-turn:turns=T,prompt=P,user=U,output=O`: conversations of T turns; turn 0's prompt is P
  tokens, turn k's the conversation so far (turn k-1's prompt, an O-token assistant reply, U
  new user tokens), O output tokens each. The reply in the next prompt is fixed random tokens,
  not the generated ones. Requests go turn by turn (every conversation's turn 0 first).
`--num-prompts` counts requests. Errors name the workload, the key and the model's context.
"""

from __future__ import annotations

import numpy as np

from nanosched.errors import ConfigError
from nanosched.runtime.requests import Request, SamplingParams

TRACES = {"shared-prefix": ("groups", "prefix", "unique", "output"),
          "multi-turn": ("turns", "prompt", "user", "output")}


def is_trace(workload: str) -> bool:
    """Whether `workload` names one of TRACES (NAME:...) rather than a dataset or a file."""
    return workload.partition(":")[0] in TRACES and ":" in workload


def parse_trace(workload: str) -> tuple[str, dict[str, int]]:
    """NAME and its KEY=VALUE settings, each a positive integer, every key of the name given."""
    name, _, rest = workload.partition(":")
    keys = TRACES[name]
    form = f"{name}:" + ",".join(f"{k}=N" for k in keys)
    values: dict[str, int] = {}
    for item in filter(None, rest.split(",")):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or key not in keys:
            raise ConfigError(f"--workload {workload!r}: {item!r} is not one of "
                              f"{', '.join(k + '=N' for k in keys)} (form: {form})")
        try:
            values[key] = int(text)
        except ValueError:
            raise ConfigError(f"--workload {workload!r}: {key} must be an integer, got "
                              f"{text!r}") from None
        if values[key] < (0 if key == "unique" else 1):
            raise ConfigError(f"--workload {workload!r}: {key} must be "
                              f"{'>= 0' if key == 'unique' else 'positive'}, got {values[key]}")
    missing = [k for k in keys if k not in values]
    if missing:
        raise ConfigError(f"--workload {workload!r}: missing {', '.join(missing)} (form: {form})")
    return name, values


def trace_requests(workload: str, num_prompts: int, vocab_size: int, max_len: int,
                   seed: int = 0, ignore_eos: bool = True) -> list[Request]:
    """The `num_prompts` requests of a TRACES workload (see the module's docstring)."""
    name, v = parse_trace(workload)
    if num_prompts < 1:
        raise ConfigError(f"--num-prompts must be a positive integer, got {num_prompts}")
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return [int(x) for x in rng.integers(0, vocab_size, size=n)]

    if name == "shared-prefix":
        need = v["prefix"] + v["unique"] + v["output"]
        _fits(workload, need, max_len, "prefix + unique + output")
        prefixes = [ids(v["prefix"]) for _ in range(v["groups"])]
        prompts = [prefixes[i % v["groups"]] + ids(v["unique"]) for i in range(num_prompts)]
    else:
        turns, out = v["turns"], v["output"]
        need = v["prompt"] + (turns - 1) * (out + v["user"]) + out
        _fits(workload, need, max_len, "prompt + (turns - 1) x (output + user) + output")
        convs = -(-num_prompts // turns)
        talk = [ids(v["prompt"]) for _ in range(convs)]
        prompts = []
        for turn in range(turns):
            for c in range(convs):
                if turn:
                    talk[c] = talk[c] + ids(out) + ids(v["user"])
                prompts.append(talk[c])
        prompts = prompts[:num_prompts]
    params = SamplingParams(max_tokens=v["output"], ignore_eos=ignore_eos)
    return [Request(i, list(p), params) for i, p in enumerate(prompts)]


def _fits(workload: str, need: int, max_len: int, what: str) -> None:
    if need > max_len:
        raise ConfigError(f"--workload {workload!r}: {what} = {need} tokens exceeds the "
                          f"model's context of {max_len} tokens")
