"""Search a schedule set (`nanosched.schedule/2`): one decision per batch shape the engine runs.

Keys are every (D decode, T tokens) on the 128-token grid up to the dense batch
(`schedules.sets.set_keys`). Each key is decided in one of three ways, cheapest first: too
small for two nano-batches, bounded below `min_gain` (by `overlap_bound` or the resource
ceiling of proof.py), or searched by `run_search`. `search_set` returns the `ScheduleSet`.

More in docs/search.md, module notes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from nanosched.autosearch.cpsat import Progress
from nanosched.autosearch.proof import resource_ceiling, with_proof
from nanosched.autosearch.search import SearchConfig, run_search, search_batch
from nanosched.constants import SEQUENTIAL, TOKEN_QUANTUM
from nanosched.errors import ScheduleError
from nanosched.models import ops as optable
from nanosched.models.costmodel import kv_capacity_tokens
from nanosched.models.ops import COMPUTE, MEMORY, NETWORK, OTHER
from nanosched.schedules.format import BatchInfo, model_record
from nanosched.schedules.sets import (
    PIPELINE,
    ScheduleSet,
    SetEntry,
    fitting_context,
    layer_times_us,
    set_keys,
)

MIN_GAIN = 1.05  # a pipeline entry must predict this much over Sequential (see shipped.py)
STEADY_SHARE = 0.2  # of the set's time for the steady-state key (at most 60 s)
# The least solver time a searched key gets. Below a few seconds CP-SAT returns the solution its
# hint (the nearest key's counts) leads to; a set of 150 keys (dense batch 2,048) still ends
# near its time limit.
MIN_KEY_S = 0.5


@dataclass(frozen=True)
class SetSearchConfig:
    """A set search: `base` gives the model, profile, workload, dense batch, workers and the
    whole set's time limit (`base.time_limit_s`); `keys` limits the keys (default: all)."""

    base: SearchConfig
    min_gain: float = MIN_GAIN
    keys: tuple[tuple[int, int], ...] | None = None
    bound: bool = True  # decide keys the bound rules out without a solve (False: search them)


@dataclass(frozen=True)
class KeyResult:
    key: tuple[int, int]
    entry: SetEntry
    how: str  # "small" | "bounded" | "ceiling" | "searched" | "failed" | "unsearched"
    wall_s: float


def key_config(cfg: SearchConfig, d: int, t: int) -> SearchConfig:
    """The search of key (D, T): D decode of T tokens at the workload's contexts, the decode
    context shortened to what fits in the profiled GPU's KV cache beside T - D prompt tokens (the
    engine never holds more: 1,408 decode rows of 1,280 tokens exceed an H200's bf16 cache), in
    the profile's KV dtype (an FP8 cache holds about twice the tokens), but not below the
    profile's shortest measured decode context."""
    kcfg = replace(cfg, dense_batch=t, num_decode=d)
    if d == 0 or not cfg.profile.identity.memory_bytes:
        return kcfg
    c = context_notes(cfg)
    return replace(kcfg, decode_context=fitting_context(c["workload"], c["least"],
                                                        c["kv_capacity_tokens"], d, t))


def context_notes(cfg: SearchConfig) -> dict[str, float]:
    """What `key_config` fits each key's decode context by, as a set records it (so that
    `ScheduleSet.sequential_us` weighs a batch between keys by the context it can have): the
    workload's decode context, the profile's shortest measured one, and the KV tokens the
    profiled GPU's cache holds (0: unknown, nothing shortened)."""
    mem = cfg.profile.identity.memory_bytes
    return {"workload": search_batch(cfg).decode_context,
            "least": float(min((r.context for r in cfg.profile.kernels
                                if r.op == optable.ATTN_DECODE and r.context), default=1)),
            "kv_capacity_tokens": kv_capacity_tokens(cfg.spec, cfg.tp, mem, cfg.dense_batch,
                                                     kv_dtype=cfg.profile.kv_dtype,
                                                     quantization=cfg.profile.quantization)
            if mem else 0.0}


def key_batch(cfg: SearchConfig, d: int, t: int) -> BatchInfo:
    """The batch of key (D, T), as `run_search` searches it (`key_config`)."""
    return search_batch(key_config(cfg, d, t))


def sequential_forward_us(cfg: SearchConfig, batch: BatchInfo) -> float:
    """Predicted GPU time of a Sequential forward's layers (no LM head) at `batch`."""
    from nanosched.autosearch.simulate import sequential_baseline

    return sequential_baseline(cfg.spec, cfg.tp, cfg.profile, batch)[0] * cfg.spec.num_layers


def max_p_sum(cfg: SearchConfig) -> float:
    """The largest P_compute + P_other of any R->P point the search can pick, folded or of one
    shape (1 when none beats alone): a per-shape point may sum higher than the fold, and the
    bound must hold for every allocation."""
    tables = (*cfg.profile.rp.values(), *cfg.profile.rp_shapes.values())
    return max([1.0, *(p.p_compute + p.p_other for pts in tables for p in pts)])


def overlap_bound(cfg: SearchConfig, batch: BatchInfo) -> float:
    """An upper bound of the gain over Sequential that any schedule at `batch` can be
    predicted (docs/search.md, 2.)."""
    from nanosched.autosearch.opgraph import TokenMix, layer_graph
    from nanosched.autosearch.search import _tables
    from nanosched.autosearch.stage1_bounds import class_loads, op_min_ticks

    graph = layer_graph(cfg.spec, cfg.tp)
    tables = _tables(cfg, graph, batch)
    # an op may run faster than on the whole GPU only in a pair, whose P are against the rows
    fastest = {op: [min(a, b) for a, b in zip(t, bare, strict=True)]
               for (op, t), bare in zip(tables.items(),
                                        _tables(cfg, graph, batch, settled=False).values(),
                                        strict=True)}
    mix = TokenMix(batch.dense_batch, batch.num_decode, batch.prompt_len)

    def least(op: str, quanta: int, whole: bool) -> int:
        # split into 2..max_nano_ops pieces over the batch (run_search's counts), 1.. over a part
        return min(op_min_ticks(fastest[op], c, quanta, whole)
                   for c in range(2 if whole else 1, max(2, min(cfg.max_nano_ops, quanta)) + 1))

    load = class_loads(graph, mix, least)
    work = load[COMPUTE] + load[MEMORY] + load[OTHER]
    period = max(load[COMPUTE], load[MEMORY], load[NETWORK], work / max_p_sum(cfg), 1)
    seq = 0
    for o in graph.active_ops({g: "ar" for g in graph.groups()}):
        lo, hi = mix.domain(o.domain)
        seq += tables[o.name][(hi - lo) // TOKEN_QUANTUM]  # an empty part: table[0] = 0
    return seq / period


def rule_out(cfg: SetSearchConfig, batch: BatchInfo, key: tuple[int, int], seq: float
             ) -> tuple[SetEntry, str] | float | None:
    """A key decided without a solve, as (its sequential entry, how: small, bounded or
    ceiling); else the resource ceiling to keep for its proof (None: `cfg.bound` is off, so
    neither bound was computed)."""
    d, t = key
    if t < 2 * TOKEN_QUANTUM:
        return SetEntry(d, t, SEQUENTIAL, seq, seq, "fewer than two 128-token nano-batches",
                        proof="small"), "small"
    if not cfg.bound:
        return None
    bound = overlap_bound(cfg.base, batch)
    if bound < cfg.min_gain:
        return SetEntry(d, t, SEQUENTIAL, seq, seq, f"bound: no schedule can beat "
                        f"{bound:.3f}x (needs {cfg.min_gain:.2f}x)", proof="bound"), "bounded"
    top = resource_ceiling(cfg.base, batch).gain
    if top < cfg.min_gain:
        return SetEntry(d, t, SEQUENTIAL, seq, seq, f"ceiling: no pipeline can beat "
                        f"{top:.3f}x (needs {cfg.min_gain:.2f}x)", proof="ceiling",
                        ceiling=top), "ceiling"
    return top


def _ceiling(known: float | None, base: SearchConfig, kcfg: SearchConfig) -> float:
    """The key's resource ceiling: `known`, else computed now."""
    return known if known is not None else resource_ceiling(base, search_batch(kcfg)).gain


def _unsearched(key: tuple[int, int], seq: float, ceiling: float | None,
                min_gain: float) -> KeyResult:
    """A key left when the set's time limit ran out: Sequential, its NO GAIN unproven unless
    the ceiling computed before the search proves it."""
    entry = SetEntry(key[0], key[1], SEQUENTIAL, seq, seq,
                     "not searched: the time limit ran out (raise --time-limit)")
    return KeyResult(key, with_proof(entry, None, ceiling, min_gain), "unsearched", 0.0)


def search_order(keys: list[tuple[int, int]], start: tuple[int, int]) -> list[tuple[int, int]]:
    """`keys` breadth first from `start` over the grid's neighbours (D ± q, T ± q, both - q),
    so each key comes right after keys next to it."""
    if not keys:
        return []
    q, todo, top = TOKEN_QUANTUM, set(keys), max(t for _, t in keys)
    out: list[tuple[int, int]] = []
    queue, seen = deque([start]), {start}
    while queue:
        key = queue.popleft()
        if key in todo:
            out.append(key)
        d, t = key
        for nb in ((d, t - q), (d - q, t), (d + q, t), (d, t + q), (d - q, t - q)):
            if nb not in seen and 0 <= nb[0] <= nb[1] and q <= nb[1] <= top:
                seen.add(nb)
                queue.append(nb)
    return out + [k for k in keys if k not in set(out)]


def nearest(key: tuple[int, int], found: dict[tuple[int, int], dict[str, int]]
            ) -> dict[str, int] | None:
    """The nano-op counts of the searched key nearest to `key` (None before any)."""
    if not found:
        return None
    d, t = key
    return found[min(found, key=lambda k: (abs(k[0] - d) + abs(k[1] - t), k))]


def _counts(entry_schedule: object) -> dict[str, int]:
    return {op: len(r) for op, r in entry_schedule.ranges.items()}  # type: ignore[attr-defined]


def search_set(cfg: SetSearchConfig, progress: Progress | None = None,
               on_key: Callable[[KeyResult, int, int], None] | None = None,
               on_decided: Callable[[list[KeyResult], int, int], None] | None = None
               ) -> ScheduleSet:
    """Decide every key; returns the set (entries in key order). `on_key(result, i, n)` is
    called after each key; `on_decided(results, to_search, n)` once the keys that need no
    search (too small, bounded, below the ceiling) are decided, before the first search."""
    base = cfg.base
    start_t = time.perf_counter()
    deadline = start_t + base.time_limit_s
    keys = list(cfg.keys) if cfg.keys is not None else set_keys(base.dense_batch)
    steady = search_batch(base)
    start = (steady.num_decode, steady.dense_batch)
    results: dict[tuple[int, int], KeyResult] = {}
    counts: dict[tuple[int, int], dict[str, int]] = {}
    sequential: dict[tuple[int, int], float] = {}
    configs: dict[tuple[int, int], SearchConfig] = {}  # each key's search: its batch's source
    contexts: dict[tuple[int, int], float] = {}  # each key's decode context, as searched
    ceilings: dict[tuple[int, int], float | None] = {}  # None: not computed before the search
    to_search = []
    for key in keys:
        d, t = key
        t0 = time.perf_counter()
        configs[key] = key_config(base, d, t)
        batch = search_batch(configs[key])
        contexts[key] = batch.decode_context
        seq = sequential[key] = sequential_forward_us(base, batch)
        decided = rule_out(cfg, batch, key, seq)
        if isinstance(decided, tuple):
            results[key] = KeyResult(key, decided[0], decided[1], time.perf_counter() - t0)
            continue
        ceilings[key] = decided
        to_search.append(key)
    n = len(keys)
    done = len(results)
    if on_key:
        for i, r in enumerate(results.values()):
            on_key(r, i + 1, n)
    order = search_order(to_search, start)
    if on_decided:
        on_decided(list(results.values()), len(order), n)
    over, extra = 0.0, 0.0  # mean and sum of what keys took beyond their solver budget
    for i, key in enumerate(order):
        d, t = key
        rest = len(order) - i
        if i > 0 and not base.deterministic and \
                deadline - time.perf_counter() < MIN_KEY_S + over:
            for j, late in enumerate(order[i:]):  # the set's time is spent (docs/search.md)
                results[late] = _unsearched(late, sequential[late], ceilings[late], cfg.min_gain)
                if on_key:
                    on_key(results[late], done + j + 1, n)
            break
        left = deadline - time.perf_counter() - over * rest
        share = left * STEADY_SHARE if i == 0 and key == start else left / rest
        budget = max(MIN_KEY_S, min(60.0, share)) if len(order) > 1 else max(MIN_KEY_S, left)
        if base.deterministic:
            budget = base.time_limit_s / max(1, len(order))
        t0 = time.perf_counter()
        seq = sequential[key]
        kcfg = replace(configs[key], time_limit_s=budget, counts=nearest(key, counts))
        if progress:
            progress(f"key D={d} T={t}: searching ({budget:.0f} s)")
        try:
            sched = run_search(kcfg, progress)
        except ScheduleError as exc:
            if key == start:  # the steady state's batch is the one that matters: say why
                raise
            entry = SetEntry(d, t, SEQUENTIAL, seq, seq, f"search failed: {exc}")
            entry = with_proof(entry, None, _ceiling(ceilings[key], base, kcfg), cfg.min_gain)
            results[key] = KeyResult(key, entry, "failed", time.perf_counter() - t0)
        else:
            counts[key] = _counts(sched)
            forward = layer_times_us(sched)[0]
            gain = seq / forward
            if gain >= cfg.min_gain:
                entry = SetEntry(d, t, PIPELINE, forward, seq,
                                 f"searched: {gain:.3f}x", sched)
            else:  # the steady state keeps the pipeline it found, for `show` (never run)
                entry = SetEntry(d, t, SEQUENTIAL, seq, seq, f"searched: the best pipeline "
                                 f"found predicts {gain:.3f}x (needs {cfg.min_gain:.2f}x)",
                                 sched if key == start else None)
            entry = with_proof(entry, sched, _ceiling(ceilings[key], base, kcfg), cfg.min_gain)
            results[key] = KeyResult(key, entry, "searched", time.perf_counter() - t0)
        extra += max(0.0, time.perf_counter() - t0 - budget)  # model building, stage II
        over = extra / (i + 1)
        done += 1
        if on_key:
            on_key(results[key], done, n)
    how = [r.how for r in results.values()]
    prof = base.profile
    return ScheduleSet(
        model_record(base.spec), base.tp, prof.identity.gpu_name, prof.identity.num_sms,
        prof.digest(), base.dense_batch,
        tuple(replace(results[k].entry, decode_context=contexts[k] if k[0] else None)
              for k in sorted(results)),
        prof.kv_dtype, base.workload.name, cfg.min_gain,
        {"wall_s": round(time.perf_counter() - start_t, 1), "time_limit_s": base.time_limit_s,
         "deterministic": base.deterministic, "workers": base.num_workers, "keys": n,
         "searched": how.count("searched"),
         "bounded": how.count("bounded"), "ceiling": how.count("ceiling"),
         "small": how.count("small"),
         "failed": how.count("failed"), "unsearched": how.count("unsearched"),
         "max_p_sum": round(max_p_sum(base), 4),
         "steady_key": list(start), "contexts": context_notes(base)},
        datetime.now(timezone.utc).isoformat(timespec="seconds"), base.command,
        quantization=prof.quantization)
