"""Request-length statistics of the workloads nanosched benchmarks and plans for.

`Workload` carries the average prompt length p and output length d that the cost model and the
search need. The named datasets are NanoFlow's Table 4 (mean and standard deviation of input and
output lengths in tokens); the engine draws seeded synthetic traces from them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from nanosched.errors import ConfigError


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: float  # p: mean prompt tokens
    output_len: float  # d: mean output tokens
    input_std: float = 0.0
    output_std: float = 0.0

    def __post_init__(self) -> None:
        for flag, value in (("--input-len", self.input_len), ("--output-len", self.output_len)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{flag} must be a positive number of tokens, got {value!r}")
        for flag, value in (("input std", self.input_std), ("output std", self.output_std)):
            if value < 0:
                raise ConfigError(f"workload {self.name!r}: {flag} must be >= 0, got {value}")

    @property
    def decode_fraction(self) -> float:
        """Share of a steady-state dense batch that is decode tokens: d / (p + d)."""
        return self.output_len / (self.input_len + self.output_len)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Workload:
        return cls(**data)


DATASETS: dict[str, Workload] = {
    "splitwise": Workload("splitwise", 1155, 211, 1109, 163),
    "lmsys": Workload("lmsys", 102, 222, 169, 210),
    "sharegpt": Workload("sharegpt", 246, 322, 547, 244),
}


def fixed(input_len: float, output_len: float) -> Workload:
    """Constant lengths, named like vLLM's benchmark flags."""
    return Workload(f"in{input_len:g}-out{output_len:g}", input_len, output_len)


def resolve_workload(workload: str | None, input_len: float | None,
                     output_len: float | None, default: tuple[float, float] = (1024, 512)
                     ) -> Workload:
    """A named dataset, or fixed lengths (defaults to NanoFlow's input 1024 / output 512)."""
    if workload is not None:
        if input_len is not None or output_len is not None:
            raise ConfigError("give either --workload or --input-len/--output-len, not both")
        if workload not in DATASETS:
            raise ConfigError(f"--workload {workload!r} is not known; known: "
                              f"{', '.join(DATASETS)}")
        return DATASETS[workload]
    if (input_len is None) != (output_len is None):
        raise ConfigError("--input-len and --output-len go together; give both or neither")
    if input_len is None:
        input_len, output_len = default
    return fixed(input_len, output_len)
