"""The schedule-set contract, `nanosched.schedule/2`: one searched decision per batch bucket.

The engine runs batches of every shape: full ones in the steady state, smaller ones while the
batch fills (the ramp) and empties (the tail), decode-heavy or prefill-heavy ones as requests
arrive and end. A set holds, for every *key* (D decode rows, T rows; both multiples of the
128-token quantum, 0 <= D <= T <= the dense batch B), an entry that says how to run a batch of
that shape: a searched pipeline (`kind: "pipeline"`, a whole `nanosched.schedule/1` schedule
searched at D decode + T - D prefill tokens), or `kind: "sequential"` where the search, or a
bound that no schedule can beat, says that no pipeline gains at least `min_gain` there. Every
entry records the predicted forward time of the GPU work (`forward_us`, layers only: the LM
head is outside the replayed graph) of what it runs and of Sequential (`sequential_us`), and
`reason`, the search's words for its decision.

More in docs/search.md, module notes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from nanosched.constants import SEQUENTIAL, TOKEN_QUANTUM
from nanosched.errors import ScheduleError
from nanosched.fileio import check_fields, read_json, write_json_atomic
from nanosched.schedules.format import FORMAT as SINGLE_FORMAT
from nanosched.schedules.format import REPLAYED_FORMS, Schedule, check_compatible

SET_FORMAT = "nanosched.schedule/2"
PIPELINE = "pipeline"  # a searched schedule runs this batch shape
KINDS = (PIPELINE, SEQUENTIAL)
# how a sequential entry's NO GAIN is proven, strongest first (autosearch/proof.py), or not
PROOFS = ("small", "bound", "ceiling", "gap", "unproven")
GAP_PROVEN = 0.05  # a stage whose gap is at most this has converged, for the `gap` proof
# written when set
OPTIONAL = ("decode_context", "proof", "ceiling", "stage1_gap", "stage2_gap", "structure_bound")


@dataclass(frozen=True)
class SetEntry:
    """The decision for one key: run `schedule` (a pipeline) or Sequential."""

    num_decode: int
    num_tokens: int
    kind: str
    forward_us: float  # predicted GPU time of a forward's layers as this entry runs it
    sequential_us: float  # the same under Sequential
    reason: str = ""
    schedule: Schedule | None = None  # the pipeline (a sequential entry may keep the best one
    # the search found, never run, for `show`)
    measured: dict[str, Any] | None = None  # `nanosched verify` on a GPU: both times, gain
    decode_context: float | None = None  # the decode rows' mean context the key was priced
    # at (what fits the cache: `fitting_context`); None in older files
    # Whether a sequential entry's NO GAIN is proven (autosearch/proof.py; None in older files
    # and for pipelines): how (`PROOFS`), the resource ceiling (the most any pipeline the
    # search can return is predicted to gain here), the gaps of the stages of the best
    # pipeline the search found and stage II's bound for its structure as a gain.
    proof: str | None = None
    ceiling: float | None = None
    stage1_gap: float | None = None
    stage2_gap: float | None = None
    structure_bound: float | None = None

    @property
    def key(self) -> tuple[int, int]:
        return self.num_decode, self.num_tokens

    @property
    def speedup(self) -> float:
        """Predicted gain of this entry over Sequential (1.0 for a sequential entry)."""
        return self.sequential_us / self.forward_us

    def to_json(self) -> dict[str, Any]:
        out = {"num_decode": self.num_decode, "num_tokens": self.num_tokens, "kind": self.kind,
               "forward_us": self.forward_us, "sequential_us": self.sequential_us,
               "reason": self.reason,
               "schedule": self.schedule.to_json() if self.schedule is not None else None,
               "measured": self.measured}
        for name in OPTIONAL:  # absent from older files: they round-trip as read
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class ScheduleSet:
    """Entries by key, for one model, tp, GPU, profile and KV cache dtype."""

    model: dict[str, Any]
    tp: int
    gpu_name: str
    num_sms: int
    profile_digest: str
    dense_batch: int
    entries: tuple[SetEntry, ...]
    kv_dtype: str = "auto"
    workload: str = ""
    min_gain: float = 1.0
    search: dict[str, Any] | None = None  # how the set was searched (times, counts)
    created: str = ""
    command: str = ""
    source_format: str = SET_FORMAT  # the format of the file it came from (not written)
    quantization: str = "none"  # the profile's layer weights (written only when not none)

    def entry(self, num_decode: int, num_tokens: int) -> SetEntry | None:
        """The entry of the bucket with `num_decode` decode rows of `num_tokens` rows (its
        key by `set_key`), or None when the set has none."""
        key = set_key(num_decode, num_tokens, self.dense_batch)
        return self._by_key.get(key) if key is not None else None

    @cached_property
    def _by_key(self) -> dict[tuple[int, int], SetEntry]:
        return {e.key: e for e in self.entries}

    def sequential_us(self, num_decode: int, num_tokens: int) -> float | None:
        """Predicted Sequential forward (layers) of a batch of `num_decode` decode rows out of
        `num_tokens`: between the keys either side in D, then linear in T, over the keys'
        `sequential_us` (rows below the quantum are priced at the quantum: the profile holds
        nothing smaller). In D the weight is that of the decode rows' KV tokens (rows x the
        context that fits, `decode_kv_tokens`), which the decode attention's time follows:
        where the upper key's rows had to be priced at a shorter context than the workload's
        (the cache holds no more), a batch in between is nearer the upper key than its row
        count says. Linear in D for sets that do not record the contexts. None when a key it
        needs is missing (a `/1` file)."""
        q, keys = TOKEN_QUANTUM, self._by_key

        def row(t: int) -> float | None:
            d = min(max(num_decode, 0), t)
            lo, hi = d // q * q, min(t, -(-d // q) * q)
            a, b = keys.get((lo, t)), keys.get((hi, t))
            if a is None or b is None:
                return None
            w = 0.0
            if hi != lo:
                w = (d - lo) / (hi - lo)
                ka = self.decode_kv_tokens(lo, t, a.decode_context)
                kb = self.decode_kv_tokens(hi, t, b.decode_context)
                kd = self.decode_kv_tokens(d, t)
                if None not in (ka, kb, kd) and kb > ka:
                    w = min(1.0, max(0.0, (kd - ka) / (kb - ka)))
            return (1 - w) * a.sequential_us + w * b.sequential_us

        t = min(max(num_tokens, q), self.dense_batch)
        t0 = t // q * q
        t1 = min(self.dense_batch, t0 + q) if t % q else t0
        a, b = row(t0), row(t1)
        if a is None or b is None:
            return None
        w = 0.0 if t1 == t0 else (t - t0) / (t1 - t0)
        return (1 - w) * a + w * b

    def decode_kv_tokens(self, num_decode: int, num_tokens: int,
                         context: float | None = None) -> float | None:
        """KV tokens the decode rows of a (D, T) shape read: rows x their context, `context`
        when given (a key's own), else what fits there by the search's notes
        (`fitting_context`); None when neither is known."""
        if context is not None and num_decode:
            return num_decode * context
        ctx = (self.search or {}).get("contexts")
        if not ctx:
            return None
        return num_decode * fitting_context(ctx["workload"], ctx["least"],
                                            ctx["kv_capacity_tokens"], num_decode, num_tokens)

    def predict_us(self, num_decode: int, num_tokens: int) -> float | None:
        """Predicted forward (layers) of that batch as the set runs it: `sequential_us` there,
        over its entry's predicted gain when the entry is a pipeline."""
        seq = self.sequential_us(num_decode, num_tokens)
        e = self.entry(num_decode, num_tokens)
        if seq is None or e is None:
            return None
        return seq / e.speedup if e.kind == PIPELINE else seq

    @property
    def pipelines(self) -> list[SetEntry]:
        return [e for e in self.entries if e.kind == PIPELINE]

    @property
    def full(self) -> SetEntry | None:
        """The entry of the steady state's batch: the search's steady key (the workload's mix
        at the dense batch) when the set records it; else (a `/1` file, a set without search
        notes) the best pipeline at the dense batch, the entry there that kept a pipeline, or
        any entry there."""
        steady = tuple((self.search or {}).get("steady_key", ()))
        if len(steady) == 2 and (e := self.entry(*steady)) is not None \
                and e.key == steady:
            return e
        at_b = [e for e in self.entries if e.num_tokens == self.dense_batch]
        pipes = [e for e in at_b if e.kind == PIPELINE]
        kept = [e for e in at_b if e.schedule is not None]
        return max(pipes or kept or at_b, key=lambda e: (e.speedup, e.num_decode),
                   default=None)

    def to_json(self) -> dict[str, Any]:
        return {"format": SET_FORMAT, "model": self.model, "tp": self.tp,
                "gpu_name": self.gpu_name, "num_sms": self.num_sms,
                "profile_digest": self.profile_digest, "kv_dtype": self.kv_dtype,
                "dense_batch": self.dense_batch, "quantum": TOKEN_QUANTUM,
                "workload": self.workload, "min_gain": self.min_gain,
                "search": self.search, "created": self.created, "command": self.command,
                "entries": [e.to_json() for e in self.entries]} | (
                    {} if self.quantization == "none" else {"quantization": self.quantization})

    @classmethod
    def from_json(cls, data: Any, where: str = "schedule set") -> ScheduleSet:
        """Build and validate a `/2` object (a `/1` object: `from_single`)."""
        if not isinstance(data, dict):
            raise ScheduleError(f"{where}: expected a JSON object")
        fmt = data.get("format")
        if fmt == SINGLE_FORMAT:
            return from_single(Schedule.from_json(data, where))
        if isinstance(fmt, str) and fmt.startswith("nanosched.profile/"):  # profiler/format.py
            raise ScheduleError(f"{where}: this is a profile ({fmt}), not a schedule: "
                                f"`nanosched profile show` prints it, `nanosched search "
                                f"--profile FILE` searches a schedule on it")
        if fmt != SET_FORMAT:
            raise ScheduleError(f"{where}: format is {fmt!r}, expected {SET_FORMAT!r} (or a "
                                f"single {SINGLE_FORMAT!r} schedule); search it again with "
                                f"`nanosched search` to write the current format")
        body = {k: v for k, v in data.items() if k not in ("format", "quantum")}
        if data.get("quantum", TOKEN_QUANTUM) != TOKEN_QUANTUM:
            raise ScheduleError(f"{where}: quantum is {data.get('quantum')!r}; this version "
                                f"keys sets on {TOKEN_QUANTUM}-token multiples")
        check_fields(cls, body, where, ScheduleError)
        if not isinstance(body.get("entries"), list):
            raise ScheduleError(f"{where}: entries: expected a list")
        entries = tuple(_entry(e, f"{where}: entries[{i}]")
                        for i, e in enumerate(body["entries"]))
        try:
            sset = cls(**(body | {"entries": entries}))
        except TypeError as exc:
            raise ScheduleError(f"{where}: {exc}") from exc
        validate_set(sset, where)
        return sset


def fitting_context(context: float, least: float, capacity: float | None, num_decode: int,
                    num_tokens: int) -> float:
    """The mean context `num_decode` decode rows of a `num_tokens`-row batch can have: the
    workload's `context`, shortened to what a cache of `capacity` tokens holds beside the
    batch's prompt rows (the engine never holds more), but not below `least` (the profile's
    shortest measured decode context: its rows are interpolated, not extrapolated)."""
    if num_decode <= 0 or not capacity:
        return context
    room = capacity - (num_tokens - num_decode)
    return min(context, max(float(least), room / num_decode))


def _entry(data: Any, where: str) -> SetEntry:
    check_fields(SetEntry, data, where, ScheduleError)
    sched = data.get("schedule")
    kw = dict(data) | {"schedule": Schedule.from_json(sched, f"{where}: schedule")
                       if sched is not None else None}
    return SetEntry(**kw)


def validate_set(s: ScheduleSet, where: str = "schedule set") -> None:
    """Raise ScheduleError naming the first entry or field that is wrong."""
    b, q = s.dense_batch, TOKEN_QUANTUM
    if not isinstance(b, int) or b < q or b % q:
        raise ScheduleError(f"{where}: dense_batch must be a positive multiple of {q}, got {b!r}")
    if not isinstance(s.tp, int) or s.tp < 1:
        raise ScheduleError(f"{where}: tp must be a positive integer, got {s.tp!r}")
    if isinstance(s.min_gain, bool) or not isinstance(s.min_gain, (int, float)) or \
            not 0 <= s.min_gain < math.inf:
        raise ScheduleError(f"{where}: min_gain must be a finite number >= 0 (a gain over "
                            f"Sequential; search writes 1.05), got {s.min_gain!r}")
    ctx = (s.search or {}).get("contexts") if isinstance(s.search, dict) else None
    if ctx is not None:
        fields = ("workload", "least", "kv_capacity_tokens")
        if not isinstance(ctx, dict) or any(
                isinstance(ctx.get(f), bool) or not isinstance(ctx.get(f), (int, float))
                or not math.isfinite(ctx[f]) or ctx[f] < 0 for f in fields):
            raise ScheduleError(f"{where}: search.contexts must hold {', '.join(fields)} as "
                                f"finite numbers >= 0, got {ctx!r}; search the set again")
    if not s.entries:
        raise ScheduleError(f"{where}: entries is empty; a set holds an entry (pipeline or "
                            f"sequential) for each batch shape it was searched for: search "
                            f"again")
    seen: set[tuple[int, int]] = set()
    for i, e in enumerate(s.entries):
        at = f"{where}: entries[{i}] (D={e.num_decode}, T={e.num_tokens})"
        if not (isinstance(e.num_decode, int) and isinstance(e.num_tokens, int)
                and 0 <= e.num_decode <= e.num_tokens <= b and e.num_tokens >= q
                and e.num_decode % q == 0 and e.num_tokens % q == 0):
            raise ScheduleError(f"{at}: decode rows and rows must be multiples of {q} with "
                                f"0 <= D <= T <= {b} and T >= {q}")
        if e.key in seen:
            raise ScheduleError(f"{at}: a second entry for this key")
        seen.add(e.key)
        if e.kind not in KINDS:
            raise ScheduleError(f"{at}: kind must be one of {KINDS}, got {e.kind!r}")
        for name in ("forward_us", "sequential_us"):
            v = getattr(e, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v <= 0:
                raise ScheduleError(f"{at}: {name} must be a positive finite time, got {v!r}")
        c = e.decode_context
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                              or not math.isfinite(c) or c <= 0):
            raise ScheduleError(f"{at}: decode_context must be a positive finite number of "
                                f"tokens, got {c!r}")
        _check_proof(e, at)
        if e.kind == PIPELINE and e.schedule is None:
            raise ScheduleError(f"{at}: a pipeline entry holds a schedule")
        if e.schedule is not None:
            sb = e.schedule.batch
            if (sb.num_decode, sb.dense_batch) != e.key:
                raise ScheduleError(f"{at}: its schedule is for {sb.num_decode} decode of "
                                    f"{sb.dense_batch} tokens")
            if (e.schedule.tp, e.schedule.profile_digest, e.schedule.kv_dtype,
                    e.schedule.quantization) != (s.tp, s.profile_digest, s.kv_dtype,
                                                 s.quantization):
                raise ScheduleError(f"{at}: its schedule's tp, profile, KV dtype or "
                                    f"quantization differs from the set's")


def _check_proof(e: SetEntry, at: str) -> None:
    """The proof fields of an entry: a known proof, positive gains, gaps in [0, 1]."""
    if e.proof is not None and e.proof not in PROOFS:
        raise ScheduleError(f"{at}: proof must be one of {PROOFS}, got {e.proof!r}")
    for name, top in (("ceiling", math.inf), ("structure_bound", math.inf),
                      ("stage1_gap", 1.0), ("stage2_gap", 1.0)):
        v = getattr(e, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not 0 <= v <= top or not math.isfinite(v)
                              or (top == math.inf and v <= 0)):
            raise ScheduleError(f"{at}: {name} must be a finite number in "
                                f"{'(0, inf)' if top == math.inf else '[0, 1]'}, got {v!r}")


def entry_schedule(s: ScheduleSet, key: str | None = None) -> Schedule:
    """The pipeline of the entry at `key` ("D,T"), or of the steady state's entry (also one
    the set does not run: the best the search found there, `not_run_note`); a ScheduleError
    naming the pipelined keys when there is none."""
    return _entry_at(s, key).schedule  # type: ignore[return-value]


def not_run_note(s: ScheduleSet, key: str | None = None) -> str | None:
    """What to say over the pipeline `entry_schedule` gives when the set does not run it: the
    entry is sequential (its pipeline predicts less than the set's --min-gain); None when it
    runs."""
    e = _entry_at(s, key)
    if e.kind == PIPELINE:
        return None
    gain = e.sequential_us / layer_times_us(e.schedule)[0]  # type: ignore[arg-type]
    return (f"NOT RUN: this set runs Sequential at D={e.num_decode} T={e.num_tokens}; the "
            f"pipeline shown predicts {gain:.3f}x, below the set's {s.min_gain:.2f}x")


def _entry_at(s: ScheduleSet, key: str | None) -> SetEntry:
    if key is None:
        e = s.full
        where = "the steady state's batch"
    else:
        try:
            d, t = (int(x) for x in key.split(","))
        except ValueError:
            raise ScheduleError(f"--key must be D,T (decode rows, rows), got {key!r}") from None
        e = s._by_key.get((d, t))
        where = f"D={d}, T={t}"
        if e is None:
            have = sorted(s._by_key)
            listed = " ".join(f"{d},{t}" for d, t in have[:20]) + \
                (f" and {len(have) - 20} more" if len(have) > 20 else "")
            raise ScheduleError(f"the set has no entry at {where}; its keys (D,T): "
                                f"{listed or 'none'}")
    if e is None or e.schedule is None:
        keys = " ".join(f"{p.num_decode},{p.num_tokens}" for p in s.pipelines) or "none"
        raise ScheduleError(f"the set runs Sequential at {where} and kept no pipeline there; "
                            f"pipelined keys: {keys}")
    return e


def set_key(num_decode: int, num_tokens: int, dense_batch: int) -> tuple[int, int] | None:
    """The key of a bucket of `num_decode` decode rows out of `num_tokens`: each count to the
    nearest multiple of the quantum (ties up), rows within [quantum, dense_batch]; a bucket with
    decode rows keeps a non-empty decode part, one with prefill rows a non-empty prefill part
    where the key has room for both. None for an empty or oversized bucket."""
    q = TOKEN_QUANTUM
    if num_tokens < 1 or num_tokens > dense_batch or not 0 <= num_decode <= num_tokens:
        return None
    t = min(dense_batch, max(q, (num_tokens + q // 2) // q * q))
    if num_decode == 0:
        return 0, t
    if num_decode == num_tokens:
        return t, t
    d = (num_decode + q // 2) // q * q
    lo, hi = (q, t - q) if t >= 2 * q else (0, t)
    return min(hi, max(lo, d)), t


def set_keys(dense_batch: int) -> list[tuple[int, int]]:
    """Every key of a set for `dense_batch`: (D, T), T = q .. B, D = 0 .. T."""
    q = TOKEN_QUANTUM
    return [(d, t) for t in range(q, dense_batch + 1, q) for d in range(0, t + 1, q)]


def layer_times_us(s: Schedule) -> tuple[float, float]:
    """(the predicted forward of `s`'s layers as replayed, the same under Sequential): its
    iteration times less the LM head, which runs outside the replayed graph."""
    p = s.prediction
    sequential = p.sequential_period_us * s.model["num_layers"]
    return p.iteration_us - (p.sequential_iteration_us - sequential), sequential


def from_single(s: Schedule) -> ScheduleSet:
    """A `/1` schedule as a set of one pipeline entry, at its own batch."""
    forward, sequential = layer_times_us(s)
    entry = SetEntry(s.batch.num_decode, s.batch.dense_batch, PIPELINE, max(forward, 1e-3),
                     sequential, "a single schedule", s)
    return ScheduleSet(s.model, s.tp, s.gpu_name, s.num_sms, s.profile_digest,
                       s.batch.dense_batch, (entry,), s.kv_dtype, s.batch.workload, 1.0, None,
                       s.created, s.command, SINGLE_FORMAT, s.quantization)


def load_schedule_set(path: str | os.PathLike[str]) -> ScheduleSet:
    """Read and validate a schedule file: a set (`/2`) or a single schedule (`/1`, as a set of
    one entry)."""
    p = Path(path)
    data = read_json(p, "schedule", ScheduleError)
    return ScheduleSet.from_json(data, where=f"schedule {p}")


def save_schedule_set(s: ScheduleSet, path: str | os.PathLike[str]) -> None:
    """Validate, then write atomically."""
    validate_set(s)
    write_json_atomic(path, s.to_json())


def check_set_compatible(s: ScheduleSet, model_spec: Any, tp: int, gpu_name: str,
                         force: bool = False, kv_dtype: str = "auto",
                         quantization: str = "none") -> list[str]:
    """`format.check_compatible` for a set (the same fields, the same messages), and
    `check_replayable` (which `force` does not waive: such an entry would run Sequential)."""
    reasons = check_compatible(s, model_spec, tp, gpu_name, force, kv_dtype,  # type: ignore
                               quantization)
    check_replayable(s)
    return reasons


def check_replayable(s: ScheduleSet) -> None:
    """Refuse a set with a pipeline whose collective form the runtime cannot replay (only
    `REPLAYED_FORMS`), naming its key, group and form."""
    for e in s.pipelines:
        if e.schedule is None:
            continue
        bad = {g: f for g, f in e.schedule.forms.items() if f not in REPLAYED_FORMS}
        if bad:
            g, f = next(iter(bad.items()))
            raise ScheduleError(f"schedule set entry D={e.num_decode} T={e.num_tokens}: "
                                f"collective form {f!r} of group {g!r} cannot be replayed "
                                f"(the runtime replays {', '.join(map(repr, REPLAYED_FORMS))} "
                                f"only); search again without --allow-rs-ag")
