"""The profile contract, `nanosched.profile/1`: one JSON file per GPU x model x tp.

Pure Python: the search reads profiles on machines without a GPU. The profiler writes them.
A profile holds the GPU's identity, the model and tp, the KV dtype its attention rows ran on,
the measured ceilings, the kernel rows (op, tokens, context, SMs, mechanism, implementation ->
time), the co-run pairs and the R->P tables derived from them, and optionally the forward table
(each op's settled factor in a forward). Loading checks every field and names what is wrong
(profiler/validate.py); `check_profile_for` refuses a profile of another model or tp.

More in docs/profiler.md, module notes.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from nanosched.errors import ConfigError, ProfileError
from nanosched.fileio import check_fields, read_json, write_json_atomic
from nanosched.models.ops import layer_ops
from nanosched.models.spec import ModelSpec

FORMAT = "nanosched.profile/1"
RP_CLASSES = ("memory", "network")
MAX_TOKENS = 1 << 20


# A pair measured with a shorter settle or window ran before the clock settled under the power
# cap (bench/hardware/power_settle.py: about 200 ms to settle on an H100, ripple period about 1 s).
MIN_SETTLE_MS = 200.0
MIN_WINDOW_MS = 500.0
THROTTLED = 0.97  # a clock under this share of the GPU's maximum ran throttled


@dataclass(frozen=True)
class Identity:
    gpu_name: str
    num_sms: int
    memory_bytes: int
    driver: str = ""
    cuda: str = ""
    torch: str = ""
    triton: str = ""
    date: str = ""
    command: str = ""
    max_clock_mhz: float = 0.0  # the SM clock's maximum (NVML); 0 = not known
    power_limit_w: float = 0.0  # the board's enforced power limit (NVML); 0 = not known


@dataclass(frozen=True)
class Ceilings:
    gemm_tflops_8192: float
    gemm_tflops_model: float
    copy_gbs: float
    allreduce_busbw_gbs: float | None = None
    allreduce_latency_us: float | None = None
    allreduce_modelled: bool = False


@dataclass(frozen=True)
class KernelRow:
    op: str
    tokens: int
    time_us: float
    sms: int
    mechanism: str = "full"
    impl: str = "default"
    context: int = 0  # mean KV context for attention ops, 0 otherwise
    best: bool = False
    modelled: bool = False  # derived from a model (e.g. NCCL ring formula), not measured
    clock_mhz: float | None = None  # mean SM clock while timed (None: not sampled)
    power_w: float | None = None  # mean board power while timed


@dataclass(frozen=True)
class PairRow:
    compute_op: str
    other_op: str
    other_class: str  # "memory" | "network"
    tokens: int
    mechanism: str
    compute_impl: str
    compute_sms: int
    other_sms: int  # SMs (green_ctx) or CTAs (cta_bound) given to the other kernel
    compute_alone_us: float
    other_alone_us: float
    compute_us: float
    other_us: float
    context: int = 0
    settle_ms: float = 0.0  # looped before the window (0: a burst, or not recorded)
    window_ms: float = 0.0  # the timed window (0: not recorded)
    clock_mhz: float | None = None  # mean SM clock / board power over the co-run window
    power_w: float | None = None
    compute_alone_clock_mhz: float | None = None  # over the windows of the alone times
    other_alone_clock_mhz: float | None = None
    other_impl: str = ""  # the memory kernel's implementation ("": the runtime's default)

    @property
    def sustained(self) -> bool:
        """Whether the clock had settled under the power cap when this pair was timed."""
        return self.settle_ms >= MIN_SETTLE_MS and self.window_ms >= MIN_WINDOW_MS

    @property
    def p_compute(self) -> float:
        return self.compute_alone_us / self.compute_us

    @property
    def p_other(self) -> float:
        return self.other_alone_us / self.other_us


@dataclass(frozen=True)
class RPPoint:
    r: float
    p_other: float
    p_compute: float
    mechanism: str
    compute_sms: int
    other_sms: int
    compute_impl: str = "default"
    std_rel: float = 0.0  # spread of p_other across the shapes folded into this point
    compute_op: str = ""  # per-shape points (Profile.rp_shapes) name their shape; "" if folded
    tokens: int = 0
    context: int = 0
    clock_mhz: float | None = None  # mean SM clock of the co-runs behind this point
    other_impl: str = ""  # the other side's implementation ("": the runtime's default)


@dataclass(frozen=True)
class ForwardRow:
    """One op of a Sequential layer looped until the clock settled (docs/profiler.md)."""

    op: str
    batch_tokens: int  # rows of the layer (T)
    num_decode: int  # decode rows of the layer (D)
    tokens: int  # the op's rows: D (attn_decode), T - D (attn_prefill), else T
    impl: str
    row_us: float  # the kernel row the op ran as (the profile's fastest on all SMs)
    time_us: float  # its median span inside the looped layer
    context: int = 0  # as in its kernel row
    settle_ms: float = 0.0
    window_ms: float = 0.0
    clock_mhz: float | None = None  # mean SM clock / board power over the layer's window
    power_w: float | None = None

    @property
    def factor(self) -> float:
        return self.time_us / self.row_us


@dataclass(frozen=True)
class Profile:
    identity: Identity
    model: ModelSpec
    tp: int
    dense_batch: int
    ceilings: Ceilings
    kernels: tuple[KernelRow, ...]
    pairs: tuple[PairRow, ...] = ()
    rp: dict[str, tuple[RPPoint, ...]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    rp_shapes: dict[str, tuple[RPPoint, ...]] = field(default_factory=dict)
    kv_dtype: str = "auto"
    forward: tuple[ForwardRow, ...] = ()
    quantization: str = "none"  # the layer weights the GEMM rows ran on (none | fp8)

    # ---- lookups ---------------------------------------------------------------------------
    def unsettled(self) -> str | None:
        """Why this profile's compute x memory pairs are not sustained figures, or None.

        Pairs timed in bursts (shorter than MIN_SETTLE_MS + MIN_WINDOW_MS) ran at a clock the
        power cap does not let a serving GPU keep, so their P overstate what overlap gives.
        Network pairs are timed by NCCL worker processes in short windows and not judged here."""
        memory = [p for p in self.pairs if p.other_class == "memory"]
        bursts = [p for p in memory if not p.sustained]
        if not bursts:
            return None
        longest = max(p.settle_ms + p.window_ms for p in bursts)
        how = ("no settle time or window recorded (measured before sustained pairs)"
               if longest == 0 else f"settle + window at most {longest:.0f} ms")
        return (f"{len(bursts)} of {len(memory)} co-run pairs were timed in bursts ({how}), "
                f"shorter than the {MIN_SETTLE_MS:.0f} ms settle + {MIN_WINDOW_MS:.0f} ms "
                f"window the SM clock needs under the power cap")

    def throttled(self, clock_mhz: float | None) -> bool | None:
        """Whether `clock_mhz` is under THROTTLED of the GPU's maximum (None: not known)."""
        if clock_mhz is None or not self.identity.max_clock_mhz:
            return None
        return clock_mhz < THROTTLED * self.identity.max_clock_mhz

    def token_grid(self, op: str) -> list[int]:
        return sorted({k.tokens for k in self.kernels if k.op == op})

    def sm_grid(self, op: str | None = None) -> list[int]:
        return sorted({k.sms for k in self.kernels if op is None or k.op == op})

    @cached_property
    def _rows_by_key(self) -> dict[tuple[str, int, int], list[KernelRow]]:
        """The kernel rows by (op, tokens, SMs): the search looks rows up thousands of times."""
        out: dict[tuple[str, int, int], list[KernelRow]] = {}
        for k in self.kernels:
            out.setdefault((k.op, k.tokens, k.sms), []).append(k)
        return out

    def _rows(self, op: str, tokens: int, sms: int | None) -> list[KernelRow]:
        sms = self.identity.num_sms if sms is None else sms
        rows = self._rows_by_key.get((op, tokens, sms), [])
        if not rows:
            have = self.token_grid(op)
            what = f"op {op!r} at {tokens} tokens on {sms} SMs"
            if not have:
                raise ProfileError(f"profile has no rows for {what}: op not profiled")
            raise ProfileError(f"profile has no row for {what}; measured tokens: "
                               f"{have[0]}..{have[-1]} ({len(have)} sizes), SMs: "
                               f"{self.sm_grid(op)}")
        return rows

    def kernel_time_us(self, op: str, tokens: int, sms: int | None = None,
                       context: float | None = None) -> float:
        """Fastest measured time of `op` at `tokens` on `sms` SMs (all SMs by default).

        Attention rows are also keyed by context: the time at `context` is interpolated
        between the two nearest measured contexts, never extrapolated.
        """
        rows = self._rows(op, tokens, sms)
        contexts = sorted({r.context for r in rows})
        if context is None or contexts == [0]:
            return min(r.time_us for r in rows)
        if not contexts[0] <= context <= contexts[-1]:
            raise ProfileError(f"profile has {op!r} at contexts {contexts[0]}..{contexts[-1]}, "
                               f"not {context:g}: profile the workload's context range")
        best = {c: min(r.time_us for r in rows if r.context == c) for c in contexts}
        i = bisect.bisect_left(contexts, context)
        if contexts[i] == context:
            return best[context]
        lo, hi = contexts[i - 1], contexts[i]
        w = (context - lo) / (hi - lo)
        return best[lo] * (1 - w) + best[hi] * w

    def rp_points(self, cls: str, compute_op: str | None = None,
                  tokens: int | None = None) -> tuple[RPPoint, ...]:
        """The R->P points of class `cls`, sorted by R.

        With `compute_op` and `tokens`, the points measured at that shape are returned when the
        profile kept per-shape tables (one table did not fit every shape); else the folded table.
        """
        if compute_op is not None and tokens is not None:
            own = tuple(p for p in self.rp_shapes.get(cls, ())
                        if p.compute_op == compute_op and p.tokens == tokens)
            if own:
                return tuple(sorted(own, key=lambda p: p.r))
        if cls not in self.rp or not self.rp[cls]:
            raise ProfileError(f"profile has no R->P table for class {cls!r}; has: "
                               f"{sorted(self.rp) or 'none'}")
        return tuple(sorted(self.rp[cls], key=lambda p: p.r))

    def settled_factor(self, op: str, batch_tokens: int) -> float:
        """F: how much longer than its row `op` runs alone on the whole GPU inside a forward of
        `batch_tokens` rows (docs/profiler.md, `forward`); linear in T between the measured
        layer sizes (the mean of the layers of one size), the nearest one's outside them; 1
        where the profile has no forward row of `op` (profiles without a forward table, network
        ops)."""
        by_size: dict[int, list[float]] = {}
        for r in self.forward:
            if r.op == op:
                by_size.setdefault(r.batch_tokens, []).append(r.factor)
        if not by_size:
            return 1.0
        points = sorted((t, sum(f) / len(f)) for t, f in by_size.items())
        sizes = [t for t, _ in points]
        if batch_tokens <= sizes[0]:
            return points[0][1]
        if batch_tokens >= sizes[-1]:
            return points[-1][1]
        i = bisect.bisect_left(sizes, batch_tokens)
        (t0, f0), (t1, f1) = points[i - 1], points[i]
        if t1 == batch_tokens:
            return f1
        w = (batch_tokens - t0) / (t1 - t0)
        return f0 * (1 - w) + f1 * w

    def settled_time_us(self, op: str, tokens: int, batch_tokens: int,
                        context: float | None = None) -> float:
        """`op`'s row at `tokens` (all SMs) times its settled factor in a forward of
        `batch_tokens` rows: its time alone on the whole GPU inside that forward."""
        return self.kernel_time_us(op, tokens, None, context) * self.settled_factor(
            op, batch_tokens)

    # ---- JSON ------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        data = {
            "format": FORMAT,
            "identity": _row(self.identity),
            "model": self.model.to_json(),
            "tp": self.tp,
            "dense_batch": self.dense_batch,
            "ceilings": asdict(self.ceilings),
            "kernels": [_row(k) for k in self.kernels],
            "pairs": [_row(p) for p in self.pairs],
            "rp": {c: [_row(p) for p in pts] for c, pts in self.rp.items()},
            "notes": list(self.notes),
        }
        if self.rp_shapes:  # written only when kept, so older profiles keep their digest
            data["rp_shapes"] = {c: [_row(p) for p in pts] for c, pts in self.rp_shapes.items()}
        if self.kv_dtype != "auto":  # likewise
            data["kv_dtype"] = self.kv_dtype
        if self.forward:  # likewise
            data["forward"] = [_row(r) for r in self.forward]
        if self.quantization != "none":  # likewise
            data["quantization"] = self.quantization
        return data

    def digest(self) -> str:
        """sha256 of the canonical JSON: schedules record which profile they came from."""
        return self._digest

    @cached_property
    def _digest(self) -> str:
        """Computed once: a full profile's canonical JSON is about 0.5 s of CPU, and one search
        asks for it at every key it builds and checks."""
        blob = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def from_json(cls, data: Any, where: str = "profile") -> Profile:
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: expected a JSON object")
        if data.get("format") != FORMAT:
            raise ProfileError(f"{where}: format is {data.get('format')!r}, expected {FORMAT!r}")
        prof = cls(
            identity=_build(Identity, data, "identity", where),
            model=_model(data, where),
            tp=_get(data, "tp", int, where),
            dense_batch=_get(data, "dense_batch", int, where),
            ceilings=_build(Ceilings, data, "ceilings", where),
            kernels=tuple(_build_list(KernelRow, data, "kernels", where)),
            pairs=tuple(_build_list(PairRow, data, "pairs", where, required=False)),
            rp={c: tuple(_build_list(RPPoint, data["rp"], c, f"{where}: rp"))
                for c in _get(data, "rp", dict, where, required=False) or {}},
            notes=tuple(data.get("notes", [])),
            rp_shapes={c: tuple(_build_list(RPPoint, data["rp_shapes"], c, f"{where}: rp_shapes"))
                       for c in _get(data, "rp_shapes", dict, where, required=False) or {}},
            kv_dtype=_get(data, "kv_dtype", str, where, required=False) or "auto",
            forward=tuple(_build_list(ForwardRow, data, "forward", where, required=False)),
            quantization=_get(data, "quantization", str, where, required=False) or "none",
        )
        validate(prof, where)
        return prof


# Clock and power fields are written only when recorded, so that profiles measured before they
# existed keep their digest (schedules name the profile they were searched on by digest).
_OPTIONAL = {"clock_mhz": None, "power_w": None, "settle_ms": 0.0, "window_ms": 0.0,
             "compute_alone_clock_mhz": None, "other_alone_clock_mhz": None,
             "max_clock_mhz": 0.0, "power_limit_w": 0.0, "other_impl": ""}


def _row(obj: Any) -> dict[str, Any]:
    return {k: v for k, v in asdict(obj).items() if k not in _OPTIONAL or v != _OPTIONAL[k]}


def _get(data: dict[str, Any], key: str, typ: type, where: str, required: bool = True) -> Any:
    if key not in data:
        if required:
            raise ProfileError(f"{where}: missing field {key!r}")
        return None
    value = data[key]
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ProfileError(f"{where}: field {key!r} must be {typ.__name__}, got {value!r}")
    return value


def _model(data: dict[str, Any], where: str) -> ModelSpec:
    try:
        return ModelSpec.from_json(_get(data, "model", dict, where), f"{where}: model")
    except ConfigError as exc:
        raise ProfileError(str(exc)) from None


def _build(cls: type, data: dict[str, Any], key: str, where: str) -> Any:
    return _make(cls, _get(data, key, dict, where), f"{where}: {key}")


def _build_list(cls: type, data: dict[str, Any], key: str, where: str,
                required: bool = True) -> list[Any]:
    items = _get(data, key, list, where, required) or []
    return [_make(cls, item, f"{where}: {key}[{i}]") for i, item in enumerate(items)]


def _make(cls: type, item: Any, where: str) -> Any:
    check_fields(cls, item, where, ProfileError)
    return cls(**item)


def validate(prof: Profile, where: str = "profile") -> None:
    """Check internal consistency and bounds (profiler/validate.py); raise ProfileError naming
    the first problem."""
    from nanosched.profiler.validate import validate_profile

    validate_profile(prof, where)


def check_profile_for(prof: Profile, model: ModelSpec, tp: int, gpu_name: str | None = None,
                      where: str = "profile", kv_dtype: str | None = None,
                      quantization: str | None = None) -> None:
    """Raise ProfileError unless `prof` was made for `model` at `tp` (on `gpu_name`, for a
    `kv_dtype` KV cache and `quantization` weights, where given) and its kernel table has every
    op of that model's layer.

    The one compatibility check of a profile: the search's request, its config and the
    schedule checker all ask it, so a mismatch reads the same wherever it is caught."""
    if prof.model.name != model.name:
        raise ProfileError(f"{where} was made for model {prof.model.name!r}, not {model.name!r}: "
                           f"profile this model with `nanosched profile --model {model.name}`")
    if prof.model != model:
        field, theirs, ours = next((f.name, getattr(prof.model, f.name), getattr(model, f.name))
                                   for f in fields(model)
                                   if getattr(prof.model, f.name) != getattr(model, f.name))
        raise ProfileError(f"{where} was made for a {model.name} with {field} {theirs}, not "
                           f"{ours} (another model's dimensions): profile this model with "
                           f"`nanosched profile --model {model.name}`")
    if prof.tp != tp:
        raise ProfileError(f"{where} was made for --tp {prof.tp}, not --tp {tp}")
    if gpu_name is not None and prof.identity.gpu_name != gpu_name:
        raise ProfileError(f"{where} was measured on {prof.identity.gpu_name!r}, not on "
                           f"{gpu_name!r}: profile this GPU with `nanosched profile --gpu`")
    if kv_dtype is not None and prof.kv_dtype != kv_dtype:
        raise ProfileError(f"{where} was measured on a {prof.kv_dtype!r} KV cache, not "
                           f"--kv-cache-dtype {kv_dtype}: pass --kv-cache-dtype {prof.kv_dtype} "
                           f"or another profile")
    if quantization is not None and prof.quantization != quantization:
        raise ProfileError(f"{where} was measured on {prof.quantization!r} weights, not "
                           f"--quantization {quantization}: pass --quantization "
                           f"{prof.quantization} or a profile measured with --quantization "
                           f"{quantization}")
    have = {k.op for k in prof.kernels}
    missing = [op.name for op in layer_ops(model, tp) if op.name not in have]
    if missing:
        raise ProfileError(f"{where} has no kernel rows for op(s) {', '.join(missing)}: "
                           f"re-run `nanosched profile --resume` to measure them")


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate a profile file."""
    p = Path(path)
    data = read_json(p, "profile", ProfileError, hint="; a truncated file? re-run "
                     "`nanosched profile --resume`")
    return Profile.from_json(data, where=f"profile {p}")


def save_profile(prof: Profile, path: str | os.PathLike[str]) -> None:
    validate(prof)
    write_json_atomic(path, prof.to_json())
