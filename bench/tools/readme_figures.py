"""The README's prose figures, each checked against the committed record it quotes.

`python bench/tools/results_table.py --check` (and the test that runs it) fails when a figure below
is missing from README.md, when its record no longer gives it, or when the README's prose (not
its code blocks, not the generated results table) holds a number with a unit of measure (×, %,
tokens/s, ms, us, GB/s, TB/s, MHz, W) that no figure or constant below covers. So a number
enters the README's prose only with the record it comes from. Pure Python, no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = "bench/results"


@dataclass(frozen=True)
class Figure:
    """`text` as the README prints it; `op` over the values at `paths` of `record`:
    'value' (the one value, formatted by `fmt`), 'ratio' (first / second), or 'less'
    (1 - first / second, as a percentage: how much less time the first takes)."""

    text: str
    record: str  # a file in bench/results/
    paths: tuple[str, ...]
    op: str = "value"
    fmt: str = "{:.3f}×"
    record2: str | None = None  # the second value's file, when not `record`


_H100 = "overlap_ceiling-llama3-8b-tp1-h100-20261126.json"
FIGURES: tuple[Figure, ...] = (
    # When overlap pays: the pipeline ceiling at the H100's 1024 / 512 steady state
    Figure("1.026×", _H100, ("rows[num_decode=384,num_tokens=1024].ceiling",)),
    # When overlap pays: the resource ceiling of Llama-3-70B tp = 4 on four H100s, steady state
    Figure("1.059×", "llama3-70b-tp4-h100x4-b1152-dense-20261127.set.json",
           ("entries[num_decode=384,num_tokens=1152].ceiling",)),
    # When overlap pays: two_batch on the copy-engine all-reduce against Sequential on NCCL's,
    # end to end, A-B-A over three processes (bench/tools/aba_merge.py)
    Figure("0.752×", "bench-tp4-aba-2batch-ce-llama3-70b-in1024-out512-n1000-H100-20261127.json",
           ("ratios.two_batch+graphs.tokens_per_s",)),
    # Results: an FP8 KV cache against bf16, Sequential, 1,000 prompts of 1024 / 512
    Figure("1.24×", "bench-kv-fp8-llama3-8b-in1024-out512-n1000-H100-bulk-20261126.json",
           ("runs.sequential+graphs.results.tokens_per_s",
            "runs.sequential+graphs.results.tokens_per_s"), "ratio", "{:.2f}×",
           "bench-kv-auto-llama3-8b-in1024-out512-n1000-H100-20261126.json"),
    Figure("1.18×", "archive/bench-kv-fp8-llama3-8b-in1024-out512-n1000-b2048-H200-20261126.json",
           ("runs.sequential+graphs.results.tokens_per_s",
            "runs.sequential+graphs.results.tokens_per_s"), "ratio", "{:.2f}×",
           "archive/bench-kv-auto-llama3-8b-in1024-out512-n1000-b2048-H200-20261126.json"),
    # Results: FP8 weights (W8A8) against bf16 weights, both on an FP8 KV cache, 1024 / 512
    Figure("1.35×", "archive/bench-tp1-w8a8-fp8-llama3-8b-in1024-out512-n1000-H200-20261202.json",
           ("runs.sequential+graphs.results.tokens_per_s",
            "runs.sequential+graphs.results.tokens_per_s"), "ratio", "{:.2f}×",
           "bench-tp1-fp8-llama3-8b-in1024-out512-n1000-H200-20261202.json"),
    Figure("15,914", "bench-tp1-w8a8-fp8-llama3-8b-in1000-out1000-n3000-H200-20261203.json",
           ("runs.sequential+graphs.results.output_tokens_per_s",), fmt="{:,.0f}"),
    Figure("16,459", "bench-tp1-w8a8-fp8-reserve-llama3-8b-in1000-out1000-n3000-H200-20261203.json",
           ("runs.sequential+graphs.results.output_tokens_per_s",), fmt="{:,.0f}"),
    # Results: prefix caching on against off, 1,000 requests sharing a 2,000-token prefix in 10
    # groups (200 unique prompt tokens, 256 output), FP8 weights and KV
    Figure("2.19×", "bench-tp1-w8a8-fp8-prefix-on-llama3-8b-shared-prefix-n1000-H200-20261202.json",
           ("runs.sequential+graphs.results.tokens_per_s",
            "runs.sequential+graphs.results.tokens_per_s"), "ratio", "{:.2f}×",
           "bench-tp1-w8a8-fp8-prefix-off-llama3-8b-shared-prefix-n1000-H200-20261202.json"),
    Figure("3.4×", "bench-tp1-w8a8-fp8-prefix-off-llama3-8b-shared-prefix-n1000-H200-20261202.json",
           ("runs.sequential+graphs.results.ttft_median_s",
            "runs.sequential+graphs.results.ttft_median_s"), "ratio", "{:.1f}×",
           "bench-tp1-w8a8-fp8-prefix-on-llama3-8b-shared-prefix-n1000-H200-20261202.json"),
    # Limits: a pipeline forced at the H100's steady state, timed by `nanosched verify`
    Figure("0.914×", "llama3-8b-tp1-h100-b1024-hbm-forced-20261126.verified.set.json",
           ("entries[num_decode=384,num_tokens=1024].measured.gain",)),
    # Limits: Llama-3-70B tp = 2 on two H200s, Sequential's graph over the replay's
    Figure("0.93×", "replay_timeline-tp2-llama3-70b-8layers-2xH200-dispatchfix-20261122.json",
           ("results.sequential.graph_ms", "results.replay.graph_ms"), "ratio", "{:.2f}×"),
    # Limits: `ug` on a random-weight forward's collapsed rows against N(0, 1) operands
    Figure("12%", "gemm_duty-NVIDIA_H100_80GB_HBM3-20261125T234115.json",
           ("data[operands=forward's x and w].median_tail_us",
            "data[operands=randn x, randn w (profile rows)].median_tail_us"), "less", "{:.0%}"),
)

# Numbers with units in the README's prose that are settings or specifications, not measurements.
CONSTANTS: dict[str, str] = {
    "1.05×": "the gain a schedule set needs before it pipelines a shape (search --min-gain)",
    "700 W": "the H100 SXM and H200 board power limit (NVIDIA's specification)",
}

_MEASURE = re.compile(r"\d[\d,.]*(?:-\d[\d,.]*)?(?:×|%| ?(?:tokens/s|ms|us|µs|GB/s|TB/s|MHz|W)\b)")
_SELECT = re.compile(r"^(\w+)\[(.+)\]$")


def lookup(data: Any, path: str) -> Any:
    """The value at a dotted `path`; `key[field=value,...]` picks the one list item whose fields
    (compared as text) match. Raises KeyError naming the step that does not resolve."""
    for step in _split(path):
        m = _SELECT.match(step)
        if m:
            want = dict(kv.split("=", 1) for kv in _split_top(m.group(2)))
            items = [x for x in data.get(m.group(1), []) if isinstance(x, dict) and
                     all(str(x.get(k)) == v for k, v in want.items())]
            if len(items) != 1:
                raise KeyError(f"{step}: {len(items)} items match")
            data = items[0]
        elif isinstance(data, dict) and step in data:
            data = data[step]
        else:
            raise KeyError(f"{step}: not there")
    return data


def _split(path: str) -> list[str]:
    """Dotted steps, keeping dots inside [...] (a selector's value may hold one)."""
    steps, depth, cur = [], 0, ""
    for ch in path:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "." and depth == 0:
            steps.append(cur)
            cur = ""
        else:
            cur += ch
    return steps + [cur]


def _split_top(sel: str) -> list[str]:
    return [s.strip() for s in sel.split(",") if "=" in s] if sel.count("=") > 1 else [sel]


def value_of(fig: Figure, root: Path) -> str:
    """The figure as its record gives it, formatted."""
    first = json.loads((root / RESULTS / fig.record).read_text())
    second = json.loads((root / RESULTS / fig.record2).read_text()) if fig.record2 else first
    vals = [lookup(first, fig.paths[0])] + [lookup(second, p) for p in fig.paths[1:]]
    if fig.op == "value":
        return fig.fmt.format(vals[0])
    if fig.op == "ratio":
        return fig.fmt.format(vals[0] / vals[1])
    if fig.op == "less":
        return fig.fmt.format(1 - vals[0] / vals[1])
    raise ValueError(f"unknown op {fig.op!r}")


def prose(readme: str, begin: str, end: str) -> str:
    """The README without its code blocks, inline code, link targets and generated block."""
    text = re.sub(re.escape(begin) + r".*?" + re.escape(end), "", readme, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def figure_errors(readme: str, root: Path, begin: str, end: str,
                  figures: tuple[Figure, ...] = FIGURES) -> list[str]:
    """What is wrong with the README's prose figures; empty when every one holds."""
    errors, text = [], prose(readme, begin, end)
    for fig in figures:
        try:
            got = value_of(fig, root)
        except (OSError, KeyError, ValueError, TypeError, ZeroDivisionError) as e:
            errors.append(f"figure {fig.text}: {fig.record}: {e}")
            continue
        if got != fig.text:
            errors.append(f"figure {fig.text}: {fig.record} gives {got}")
        if fig.text not in text:
            errors.append(f"figure {fig.text} is not in README.md's prose: drop it from "
                          "bench/tools/readme_figures.py or write it there")
    known = {f.text for f in figures} | set(CONSTANTS)
    for m in _MEASURE.finditer(text):
        if m.group(0).rstrip(".,") not in known:
            errors.append(f"README.md's prose has {m.group(0)!r}, which no record in "
                          "bench/tools/readme_figures.py checks")
    return errors
