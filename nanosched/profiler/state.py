"""The partial profile, `FILE.partial.json`: what a run has measured so far, saved atomically.

Format `nanosched.profile-partial/1`: settings, identity, ceilings, granted partitions, the
reference GEMM time, kernel rows, sustained alone times (the references of the pairs), pairs,
network results, the forward table's layers, skipped rows and notes. A resumed run
loads it, refuses one made for another GPU, model, tp or grid (naming which), and measures only
the rows that are missing.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from nanosched.errors import ProfileError
from nanosched.fileio import read_json, write_json_atomic
from nanosched.profiler.format import Ceilings, ForwardRow, Identity, KernelRow, PairRow
from nanosched.profiler.plan import ProfileSettings

PARTIAL_FORMAT = "nanosched.profile-partial/1"
KERNEL_FIELDS = [f.name for f in fields(KernelRow)]
PAIR_FIELDS = [f.name for f in fields(PairRow)]
FORWARD_FIELDS = [f.name for f in fields(ForwardRow)]


def partial_path(out: str | os.PathLike[str]) -> Path:
    p = Path(out)
    return p.with_name(p.name.removesuffix(".json") + ".partial.json")


@dataclass
class RunState:
    settings: dict[str, Any]
    identity: Identity
    ceilings: Ceilings | None = None
    partitions: list[tuple[int, int]] = field(default_factory=list)
    reference_us: float | None = None
    kernels: dict[tuple[Any, ...], KernelRow] = field(default_factory=dict)
    pairs: dict[tuple[Any, ...], PairRow] = field(default_factory=dict)
    # (op, impl, tokens, context) -> [us, clock_mhz, power_w], looped alone on the whole GPU
    alone: dict[tuple[Any, ...], list[Any]] = field(default_factory=dict)
    network: dict[str, Any] | None = None  # {"world", "times": [[kind, tokens, ctas, us]], ...}
    forward: dict[tuple[Any, ...], list[ForwardRow]] = field(default_factory=dict)  # per layer
    skipped: dict[str, str] = field(default_factory=dict)  # task key (str) -> reason
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PARTIAL_FORMAT, "settings": self.settings,
            "identity": asdict(self.identity),
            "ceilings": asdict(self.ceilings) if self.ceilings else None,
            "partitions": [list(p) for p in self.partitions],
            "reference_us": self.reference_us,
            "kernel_fields": KERNEL_FIELDS,
            "kernels": [[getattr(k, f) for f in KERNEL_FIELDS] for k in self.kernels.values()],
            "pair_fields": PAIR_FIELDS,
            "pairs": [[list(k), [getattr(p, f) for f in PAIR_FIELDS]]
                      for k, p in self.pairs.items()],
            "alone": [[list(k), v] for k, v in self.alone.items()],
            "forward_fields": FORWARD_FIELDS,
            "forward": [[list(k), [[getattr(r, f) for f in FORWARD_FIELDS] for r in rows]]
                        for k, rows in self.forward.items()],
            "network": self.network, "skipped": self.skipped, "notes": self.notes,
            "elapsed_s": self.elapsed_s,
        }


def kernel_key(row: KernelRow) -> tuple[Any, ...]:
    return (row.op, row.tokens, row.context, row.sms, row.mechanism, row.impl)


def save_state(state: RunState, path: Path) -> None:
    write_json_atomic(path, state.to_json(), indent=None)


def load_state(path: Path, settings: ProfileSettings, identity: Identity) -> RunState:
    """Read a partial file and check it belongs to this run; ProfileError names what differs."""
    if not path.exists():
        raise ProfileError(f"--resume: no partial profile {path}; run without --resume to "
                           f"start one")
    data = read_json(path, "--resume: partial profile", ProfileError,
                     hint="; delete it and run without --resume")
    if not isinstance(data, dict) or data.get("format") != PARTIAL_FORMAT:
        raise ProfileError(f"--resume: {path} is not a partial profile ({PARTIAL_FORMAT})")
    _check_same(data, settings, identity, path)
    try:
        state = RunState(settings=data["settings"], identity=Identity(**data["identity"]))
        state.ceilings = Ceilings(**data["ceilings"]) if data["ceilings"] else None
        state.partitions = [(int(a), int(b)) for a, b in data["partitions"]]
        state.reference_us = data["reference_us"]
        for values in data["kernels"]:
            row = KernelRow(**dict(zip(data["kernel_fields"], values, strict=True)))
            state.kernels[kernel_key(row)] = row
        for key, values in data["pairs"]:
            state.pairs[tuple(key)] = PairRow(**dict(zip(data["pair_fields"], values,
                                                         strict=True)))
        state.alone = {tuple(k): list(v) for k, v in data.get("alone", [])}
        names = data.get("forward_fields", FORWARD_FIELDS)
        state.forward = {tuple(k): [ForwardRow(**dict(zip(names, r, strict=True))) for r in rows]
                         for k, rows in data.get("forward", [])}
        state.network, state.skipped = data["network"], dict(data["skipped"])
        state.notes, state.elapsed_s = list(data["notes"]), float(data["elapsed_s"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"--resume: {path} is damaged ({exc!r}); delete it and run without "
                           f"--resume") from exc
    return state


def _check_same(data: dict[str, Any], settings: ProfileSettings, identity: Identity,
                path: Path) -> None:
    mine = settings.to_json()
    theirs = data.get("settings") or {}
    # runs before FP8 caches measured bf16 ones, runs before FP8 weights unquantised ones
    theirs = {"kv_dtype": "auto", "quantization": "none", **theirs}
    for key in ("model", "tp", "dense_batch", "quick", "workload", "pair_settle_ms",
                "pair_window_ms", "kv_dtype", "quantization"):
        if theirs.get(key) != mine[key]:
            raise ProfileError(f"--resume: {path} was made with {key}={theirs.get(key)!r}, this "
                               f"run has {key}={mine[key]!r}; use the same flags or delete it")
    gpu = (data.get("identity") or {}).get("gpu_name")
    if gpu != identity.gpu_name:
        raise ProfileError(f"--resume: {path} was measured on {gpu!r}, this GPU is "
                           f"{identity.gpu_name!r}; delete it or resume on that GPU")
