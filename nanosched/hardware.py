"""Accelerator specifications: NanoFlow's Table 1 as named priors, overridable by measurements.

Units: memory capacity in GiB of HBM (vendors' "80 GB" parts hold 80 GiB), bandwidths in GB/s
(1e9 bytes), compute in dense FP16/BF16 GFLOP/s. `net_bw_gbs` is the per-GPU interconnect
bandwidth as the vendor quotes it (both directions); the cost model uses one direction, half of
it, as NanoFlow's Table 2 does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from nanosched.constants import DEFAULT_GPU
from nanosched.errors import ConfigError

GIB = 1 << 30


@dataclass(frozen=True)
class GPUSpec:
    name: str
    vendor: str
    year: int
    mem_gib: float
    mem_bw_gbs: float
    net_bw_gbs: float
    compute_gflops: float
    num_sms: int = 0  # 0 where the prior does not say
    source: str = "NanoFlow Table 1"

    @property
    def mem_bytes(self) -> float:
        return self.mem_gib * GIB

    @property
    def net_bw_one_way_gbs(self) -> float:
        return self.net_bw_gbs / 2

    def with_measured(self, *, compute_tflops: float | None = None,
                      mem_bw_gbs: float | None = None, net_bw_gbs: float | None = None,
                      source: str = "measured") -> GPUSpec:
        """A copy with measured ceilings replacing the priors that are given."""
        changes: dict[str, Any] = {}
        for flag, value in (("compute-tflops", compute_tflops), ("mem-bw-gbs", mem_bw_gbs),
                            ("net-bw-gbs", net_bw_gbs)):
            if value is not None and not value > 0:
                raise ConfigError(f"--{flag} must be positive, got {value}")
        if compute_tflops is not None:
            changes["compute_gflops"] = compute_tflops * 1e3
        if mem_bw_gbs is not None:
            changes["mem_bw_gbs"] = mem_bw_gbs
        if net_bw_gbs is not None:
            changes["net_bw_gbs"] = net_bw_gbs
        if changes:
            changes["source"] = f"{self.source}, {source}: {', '.join(sorted(changes))}"
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _gpu(name: str, vendor: str, year: int, mem: float, mem_bw: float, net_bw: float,
         compute: float, sms: int = 0, source: str = "NanoFlow Table 1") -> GPUSpec:
    return GPUSpec(name, vendor, year, mem, mem_bw, net_bw, compute, sms, source)


GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in [
        _gpu("v100", "NVIDIA", 2017, 16, 900, 300, 125_000, 80),
        _gpu("a100-40g", "NVIDIA", 2020, 40, 1_555, 600, 312_000, 108),
        _gpu("a100", "NVIDIA", 2021, 80, 2_000, 600, 312_000, 108),
        _gpu("h100", "NVIDIA", 2023, 80, 3_352, 900, 989_000, 132),
        # Table 1 lists 96 GB (the GH200's); the H200 SXM that `nvidia-smi` names "NVIDIA H200"
        # has 141 GB (143,771 MiB = 140.4 GiB), which decides its dense batch.
        _gpu("h200", "NVIDIA", 2024, 140.4, 4_800, 900, 989_000, 132,
             "NanoFlow Table 1; memory 140.4 GiB from the H200 SXM, not Table 1's 96"),
        _gpu("b100", "NVIDIA", 2024, 120, 8_000, 1_800, 1_800_000),
        _gpu("b200", "NVIDIA", 2024, 120, 8_000, 1_800, 2_250_000),
        _gpu("mi250", "AMD", 2021, 128, 3_352, 800, 362_000),
        _gpu("mi300", "AMD", 2023, 192, 5_300, 1_024, 1_307_000),
        _gpu("mi325x", "AMD", 2024, 256, 6_000, 1_024, 1_307_000),
        _gpu("gaudi2", "Intel", 2022, 96, 2_400, 600, 1_000_000),
        _gpu("gaudi3", "Intel", 2024, 128, 3_700, 1_200, 1_800_000),
        _gpu("ada6000", "NVIDIA", 2022, 48, 960, 64, 182_000),
    ]
}


def prior_for(device_name: str) -> GPUSpec | None:
    """The prior whose name a device name contains ("NVIDIA H200" -> h200), if any."""
    lowered = device_name.lower().replace(" ", "")
    for key in sorted(GPUS, key=len, reverse=True):  # "a100-40g" before "a100"
        if key.replace("-", "") in lowered.replace("-", ""):
            return GPUS[key]
    return None


def measured_gpu(device_name: str, memory_bytes: int, compute_tflops: float,
                 copy_gbs: float) -> GPUSpec:
    """A GPUSpec for a measured device: its prior (if known) with measured memory and ceilings."""
    base = prior_for(device_name) or GPUS[DEFAULT_GPU]
    return replace(base, name=base.name, mem_gib=memory_bytes / GIB,
                   compute_gflops=compute_tflops * 1e3, mem_bw_gbs=copy_gbs,
                   source=f"measured on {device_name}")


def get_gpu(name: str) -> GPUSpec:
    """A named prior; the error lists the known names."""
    key = name.lower().replace("_", "-")
    if key not in GPUS:
        raise ConfigError(f"--gpu {name!r} is not a known GPU; known: {', '.join(GPUS)}")
    return GPUS[key]
