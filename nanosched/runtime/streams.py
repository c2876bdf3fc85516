"""CUDA streams for a replayed schedule: plain, prioritised, or green-context partitions.

Replay names a stream by its schedule stream and SM mechanism: `compute`, `memory@prio`,
`compute@gc100`, `memory@gc32`. A `@gc<N>` stream is one side of a disjoint split of the GPU
made with the driver's SM-resource split (nanosched/greenctx.py): N SMs on one side,
the rest on the other, so the two nano-ops that the profile measured side by side on a 100/32
split run on the same pair here. A `@prio` stream gets the highest CUDA priority, as the
profile's `stream_priority` rows did. GPU-only module (`partition_sides` is plain Python).

More in docs/runtime.md, module notes.
"""

from __future__ import annotations

from typing import Any

from nanosched.runtime.device import CudaDevice


def _gc_units(key: str) -> int | None:
    _, _, mech = key.partition("@")
    return int(mech[2:]) if mech.startswith("gc") else None


def partition_sides(keys: set[str], total: int) -> dict[str, tuple[int, str]]:
    """`@gc` key -> (the split's small side in SMs, "small" or "rest"), as the module says."""
    gc = [k for k in keys if _gc_units(k) is not None]
    gc.sort(key=lambda k: (k.partition("@")[0] == "compute", k))  # compute claims last
    owner: dict[tuple[int, str], str] = {}
    sides: dict[str, tuple[int, str]] = {}
    for key in gc:
        units, stream = _gc_units(key), key.partition("@")[0]
        small = min(units, total - units)
        side = "small" if units == small else "rest"
        if owner.get((small, side), stream) != stream:
            side = "rest" if side == "small" else "small"
        owner.setdefault((small, side), stream)
        sides[key] = (small, side)
    return sides


class ReplayStreams:
    """Builds (and later closes) the streams and partitions a set of stream keys needs."""

    def __init__(self, keys: set[str], device_index: int = 0) -> None:
        import torch

        from nanosched.greenctx import split_sms

        self.total = torch.cuda.get_device_properties(device_index).multi_processor_count
        self.pairs: dict[int, Any] = {}
        streams: dict[str, Any] = {}
        priorities: dict[str, int] = {}
        urgent = min(torch.cuda.Stream.priority_range())  # lower numbers run first
        sides = partition_sides(keys, self.total)
        for key in sorted(keys):
            if key in sides:
                small, side = sides[key]
                if small not in self.pairs:
                    self.pairs[small] = split_sms(device_index, small)
                streams[key] = getattr(self.pairs[small], side).stream
            elif key.endswith("@prio"):
                priorities[key] = urgent
        self.device = CudaDevice(streams, priorities)

    def close(self) -> None:
        for pair in self.pairs.values():
            pair.close()
        self.pairs.clear()
