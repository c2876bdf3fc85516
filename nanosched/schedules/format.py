"""The schedule contract, `nanosched.schedule/1`: one JSON file the runtime replays.

Pure Python: a server loads schedules without OR-Tools. It holds the model, tp, GPU, profile
digest and KV dtype it was searched for, the batch and its mix, per op its nano-batch ranges,
the collective forms, the streams, and per nano-op its stream, issue order, layer offset,
dependencies, allocation and predicted start and duration, plus the prediction and each
stage's report. Loading and saving validate it (schedules/validate.py); `check_compatible`
refuses one made for another model, tp, GPU or KV dtype unless forced.

More in docs/search.md, module notes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nanosched.errors import ScheduleError
from nanosched.fileio import check_fields, read_json, write_json_atomic

FORMAT = "nanosched.schedule/1"
# the collective forms the runtime replays (runtime/strategies/replay.py); the search emits only
# these unless asked for more, and a set with another is refused when it is checked for a run
REPLAYED_FORMS = ("ar",)
MODEL_FIELDS = ("name", "arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "intermediate_size", "vocab_size", "num_experts",
                "num_experts_per_tok")


@dataclass(frozen=True)
class BatchInfo:
    dense_batch: int
    num_decode: int
    prompt_len: int
    decode_context: float
    prefill_context: float
    workload: str = ""


@dataclass(frozen=True)
class StreamInfo:
    name: str
    resource: str
    mechanisms: tuple[str, ...]
    units: tuple[int, ...]  # SMs (green_ctx / full) or CTAs (cta_bound) its nano-ops use


@dataclass(frozen=True)
class Alloc:
    share: float  # R: part of the GPU, 0 < share <= 1
    p: float  # performance relative to running alone
    mechanism: str
    units: int
    impl: str = "default"
    point: str = ""  # R->P point "table:index" of the profile ("" for full; absent in old files)
    side: str = ""  # "compute" | "other": which kernel of the point's measured pair it is


@dataclass(frozen=True)
class Dep:
    id: str
    shift: int = 0  # 1: on the previous layer's nano-op; -1 (resource deps only): the next's
    kind: str = "data"  # "data" | "prompt" | "resource"


@dataclass(frozen=True)
class NanoOp:
    id: str
    op: str
    resource: str
    start: int  # work range [start, end) in tokens
    end: int
    stream: str
    order: int  # issue position on its stream within a period
    layer_offset: int  # k: in period p the stream issues this nano-op of layer p - k
    deps: tuple[Dep, ...]
    alloc: Alloc
    start_us: float
    duration_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


@dataclass(frozen=True)
class Prediction:
    period_us: float  # steady-state layer time when replayed as soon as possible
    solver_period_us: float  # the period the predicted starts repeat with
    iteration_us: float
    tokens_per_s: float  # per GPU
    optimal_tokens_per_s: float  # per GPU: GEMM peak / (2 x parameters)
    sequential_period_us: float
    sequential_iteration_us: float

    @property
    def speedup(self) -> float:
        return self.sequential_iteration_us / self.iteration_us


@dataclass(frozen=True)
class StageReport:
    stage: str
    status: str
    objective_us: float
    bound_us: float
    gap: float
    wall_s: float
    time_limit_s: float
    num_workers: int
    note: str = ""


@dataclass(frozen=True)
class Schedule:
    model: dict[str, Any]
    tp: int
    gpu_name: str
    num_sms: int
    profile_digest: str
    batch: BatchInfo
    ranges: dict[str, tuple[tuple[int, int], ...]]
    forms: dict[str, str]
    streams: tuple[StreamInfo, ...]
    nano_ops: tuple[NanoOp, ...]
    prediction: Prediction
    stages: tuple[StageReport, ...]
    created: str = ""
    command: str = ""
    notes: tuple[str, ...] = ()
    kv_dtype: str = "auto"
    quantization: str = "none"  # written only when not none (module docstring)

    def nano_op(self, id_: str) -> NanoOp:
        for n in self.nano_ops:
            if n.id == id_:
                return n
        raise ScheduleError(f"schedule has no nano-op {id_!r}")

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types (lists, not tuples): equal to what a file read back gives."""
        data = {"format": FORMAT, **asdict(self)}
        if self.quantization == "none":  # older files keep their bytes and digests
            del data["quantization"]
        return json.loads(json.dumps(data))

    @classmethod
    def from_json(cls, data: Any, where: str = "schedule") -> Schedule:
        """Build and validate; ScheduleError names the first field that is wrong and why."""
        from nanosched.schedules.validate import validate

        if not isinstance(data, dict):
            raise ScheduleError(f"{where}: expected a JSON object")
        if data.get("format") != FORMAT:
            raise ScheduleError(f"{where}: format is {data.get('format')!r}, expected {FORMAT!r}")
        body = {k: v for k, v in data.items() if k != "format"}
        try:
            sched = _make(cls, body, where, {
                "batch": BatchInfo, "prediction": Prediction,
                "streams": StreamInfo, "nano_ops": NanoOp, "stages": StageReport})
        except ScheduleError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ScheduleError(f"{where}: {exc}") from exc
        validate(sched, where)
        return sched


def _make(cls: type, data: Any, where: str, nested: dict[str, type]) -> Any:
    check_fields(cls, data, where, ScheduleError)
    kw = dict(data)
    for key, sub in nested.items():
        if key not in kw:
            continue
        if isinstance(kw[key], list):
            kw[key] = tuple(_item(sub, x, f"{where}: {key}[{i}]") for i, x in enumerate(kw[key]))
        else:
            kw[key] = _item(sub, kw[key], f"{where}: {key}")
    if cls is Schedule:
        kw["ranges"] = {op: tuple(tuple(r) for r in rs) for op, rs in kw["ranges"].items()}
        kw["notes"] = tuple(kw.get("notes", ()))
    return cls(**kw)


def _item(cls: type, data: Any, where: str) -> Any:
    nested: dict[str, type] = {}
    if cls is NanoOp:
        nested = {"alloc": Alloc, "deps": Dep}
    obj = _make(cls, data, where, nested)
    if cls is StreamInfo:
        obj = StreamInfo(obj.name, obj.resource, tuple(obj.mechanisms), tuple(obj.units))
    return obj


def load_schedule(path: str | os.PathLike[str]) -> Schedule:
    """Read and validate a schedule file."""
    p = Path(path)
    data = read_json(p, "schedule", ScheduleError)
    return Schedule.from_json(data, where=f"schedule {p}")


def save_schedule(schedule: Schedule, path: str | os.PathLike[str]) -> None:
    """Validate, then write atomically (a temporary file renamed over `path`)."""
    from nanosched.schedules.validate import validate

    validate(schedule)
    write_json_atomic(path, schedule.to_json())


def model_record(spec: Any) -> dict[str, Any]:
    """The numbers of a ModelSpec that a schedule depends on."""
    return {k: getattr(spec, k) for k in MODEL_FIELDS} | {"params": spec.num_params()}


def check_compatible(schedule: Schedule, model_spec: Any, tp: int, gpu_name: str,
                     force: bool = False, kv_dtype: str = "auto",
                     quantization: str = "none") -> list[str]:
    """Refuse a schedule made for another model, tp, GPU, KV cache dtype or weight
    quantization; with `force`, return the reasons."""
    reasons = []
    want = model_record(model_spec)
    diff = [k for k in MODEL_FIELDS if schedule.model.get(k) != want[k]]
    if diff:
        k = diff[0]
        reasons.append(f"model: schedule is for {schedule.model.get('name')!r} "
                       f"({k}={schedule.model.get(k)!r}), running {want['name']!r} "
                       f"({k}={want[k]!r})")
    if schedule.tp != tp:
        reasons.append(f"tp: schedule is for tp={schedule.tp}, running tp={tp}")
    if _gpu_key(schedule.gpu_name) != _gpu_key(gpu_name):
        reasons.append(f"gpu: schedule is for {schedule.gpu_name!r}, running on {gpu_name!r}")
    if schedule.kv_dtype != kv_dtype:
        reasons.append(f"KV cache: schedule was searched on a {schedule.kv_dtype!r} profile, "
                       f"running --kv-cache-dtype {kv_dtype}")
    if schedule.quantization != quantization:
        reasons.append(f"quantization: schedule was searched on a profile of "
                       f"{schedule.quantization!r} weights, running --quantization "
                       f"{quantization}")
    if reasons and not force:
        raise ScheduleError("schedule does not match this setup: " + "; ".join(reasons)
                            + " (search a schedule for it, or force)")
    return reasons


def _gpu_key(name: str) -> str:
    """'NVIDIA H100 80GB HBM3', 'h100' and 'synthetic-h100' all name an h100."""
    words = name.lower().removeprefix("synthetic-").replace("nvidia", " ").split()
    return words[0] if words else ""
