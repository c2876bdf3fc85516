"""What the resource ceiling's optimum runs at one key of a profile: which ops beside which, for
how long, under which option and P, in which collective forms (CPU).

    PYTHONPATH=. python bench/analysis/ceiling_modes.py --profile llama3-70b-tp8-h200-quick
        [--dense-batch auto] [--input-len 1024 --output-len 512 | --workload sharegpt]
        [--key D:T] [--forms attn=ar,ffn=ar] [--nano-ops SECONDS] [--json PATH]

The key (default the steady state's) is posed as the set search poses it (`sets.key_batch`).
The LP is `nanosched.autosearch.proof`'s (`solve_modes`), under the collective forms that give
the ceiling, or under --forms. Prints each op's sequential time, its least split row time W
(what the LP must do of it), the time it runs in the optimum and beside what; then the modes,
longest first, and how busy each stream is. Writes nothing unless --json.

--nano-ops: the LP again under every choice of forms with each op's nano-ops counted, a MILP
(SCIP, at most SECONDS per form; its proven bound is kept): n_{A,k,o} integer nano-ops of op A
of k quanta under option o, covering A's domain (sum of k n = its quanta), 2..max_nano_ops of
them over the batch (1.. over an attention part), each held at one option for its whole
duration t_A(k) / P_{o,k} at the P that option has at its size; the time modes give (A, o)
equals sum_k n_{A,k,o} t_A(k) / P_{o,k}. Every replayed pipeline satisfies it (its nano-ops
are such a set, at most one nano-op of an op runs at a time, and a replayed nano-op runs
exactly that long), so it bounds them as the LP does, a little tighter: what holding one
allocation per nano-op at its size costs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections import defaultdict

from bench.analysis.search_args import add_search_args, search_config
from nanosched.autosearch.durations import alloc_options, op_context
from nanosched.autosearch.opgraph import TokenMix, layer_graph
from nanosched.autosearch.proof import (
    ModeTime,
    OpWork,
    form_ops,
    modes,
    option_key,
    resource_ceiling,
    solve_modes,
)
from nanosched.autosearch.search import SearchConfig, search_batch
from nanosched.autosearch.sets import key_batch
from nanosched.autosearch.simulate import sequential_op_times
from nanosched.constants import TOKEN_QUANTUM
from nanosched.errors import ConfigError
from nanosched.models.ops import COMPUTE, MEMORY, NETWORK
from nanosched.schedules.format import BatchInfo


def option_text(o: object) -> str:
    """An option as `mechanism point P`, e.g. `cta_bound network:2 P 0.659`."""
    point = f" {o.point}" if o.point else ""  # type: ignore[attr-defined]
    return f"{o.mechanism}{point} P {o.p:.3f}"  # type: ignore[attr-defined]


def mode_text(m: ModeTime) -> str:
    return " | ".join(f"{op} {option_text(o)}" for op, o in zip(m.ops, m.options, strict=True))


def beside(used: list[ModeTime]) -> dict[str, dict[str, float]]:
    """op -> (the op beside it, or `alone`) -> us per layer in the optimum."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for m in used:
        for op in m.ops:
            others = [o for o in m.ops if o != op]
            out[op][" + ".join(others) or "alone"] += m.us
    return out


def stream_busy(ops: list[OpWork], used: list[ModeTime]) -> dict[str, float]:
    """us per layer each stream's class runs in the optimum (elementwise ops count on the
    memory stream, where the optimum pairs them with GEMMs)."""
    cls = {o.op: o.resource for o in ops}
    busy = dict.fromkeys((COMPUTE, MEMORY, NETWORK), 0.0)
    for m in used:
        for op in m.ops:
            busy[cls[op] if cls[op] in busy else MEMORY] += m.us
    return busy


def nano_op_period(cfg: SearchConfig, batch: BatchInfo, forms: dict[str, str],
                   seconds: float) -> tuple[float, str]:
    """The least period of the LP with each op's nano-ops counted (--nano-ops, module
    docstring) under `forms`: SCIP's proven bound after at most `seconds`, and its status."""
    from ortools.linear_solver import pywraplp

    graph = layer_graph(cfg.spec, cfg.tp)
    mix = TokenMix(batch.dense_batch, batch.num_decode, batch.prompt_len)
    ops = form_ops(cfg, batch, forms)
    lp = pywraplp.Solver.CreateSolver("SCIP")
    tau = lp.NumVar(0, lp.infinity(), "tau")
    found = modes(ops)
    t = [lp.NumVar(0, lp.infinity(), f"m{k}") for k in range(len(found))]
    busy: dict[tuple[int, tuple], list] = defaultdict(list)
    for var, (idx, opts) in zip(t, found, strict=True):
        for i, o in zip(idx, opts, strict=True):
            busy[(i, option_key(o))].append(var)
    for i, work in enumerate(ops):
        op = graph.op(work.op)
        lo, hi = mix.domain(op.domain)
        quanta = (hi - lo) // TOKEN_QUANTUM
        ctx = op_context(op.name, batch.decode_context, batch.prompt_len)
        first = 2 if op.domain == "all" else 1
        top = max(first, min(cfg.max_nano_ops, quanta))
        dur: dict[tuple[tuple, int], float] = {}  # (option, k) -> t_A(k) / P at that size
        for k in range(1, quanta + 1):
            alone = cfg.profile.kernel_time_us(op.name, k * TOKEN_QUANTUM, None, ctx)
            for o in alloc_options(cfg.profile, op.resource, op.name, k * TOKEN_QUANTUM,
                                   batch.dense_batch, ctx):
                key = (option_key(o), k)
                dur[key] = min(dur.get(key, float("inf")), alone / o.p)
        n = {key: lp.IntVar(0, top, "") for key in dur}
        lp.Add(lp.Sum([v * k for (_, k), v in n.items()]) == quanta)
        lp.Add(lp.Sum(list(n.values())) >= first)
        lp.Add(lp.Sum(list(n.values())) <= top)
        for opt in {opt for opt, _ in dur}:
            lp.Add(lp.Sum(busy[(i, opt)]) == lp.Sum([v * dur[key] for key, v in n.items()
                                                     if key[0] == opt]))
    lp.Add(lp.Sum(t) <= tau)
    lp.Minimize(tau)
    lp.SetTimeLimit(int(seconds * 1000))
    status = lp.Solve()
    names = {pywraplp.Solver.OPTIMAL: "optimal", pywraplp.Solver.FEASIBLE: "time limit"}
    # the LP's period is a bound too (the MILP only adds rows): never report less
    return max(lp.Objective().BestBound(), solve_modes(ops)[0]), names.get(status, "no answer")


def parse_forms(text: str | None) -> dict[str, str] | None:
    if text is None:
        return None
    try:
        return dict(kv.split("=", 1) for kv in text.split(","))  # type: ignore[misc]
    except ValueError:
        raise ConfigError(f"--forms must read like attn=ar,ffn=rs_ag, got {text!r}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_search_args(ap)
    ap.add_argument("--key", default=None, help="D:T (default: the steady state's key)")
    ap.add_argument("--forms", default=None, help="e.g. attn=ar,ffn=rs_ag (default: the "
                    "ceiling's)")
    ap.add_argument("--nano-ops", type=float, default=None, metavar="SECONDS",
                    help="also the MILP with nano-ops counted, at most SECONDS per form")
    ap.add_argument("--json", default=None, help="write the optimum to this file")
    args = ap.parse_args()
    cfg = search_config(args)
    prof = cfg.profile
    steady = search_batch(cfg)
    d, t = (steady.num_decode, steady.dense_batch) if args.key is None else \
        map(int, args.key.split(":"))
    batch = key_batch(cfg, d, t)
    top = resource_ceiling(cfg, batch)
    forms = parse_forms(args.forms) or top.forms
    ops = form_ops(cfg, batch, forms)
    tau, used = solve_modes(ops)
    seq_ops = sequential_op_times(cfg.spec, cfg.tp, prof, batch)
    seq = sum(seq_ops.values())
    print(f"{prof.identity.gpu_name} tp={prof.tp}, key D={d} T={t} (decode context "
          f"{batch.decode_context:.0f}, prompts of {batch.prompt_len}); forms {forms or 'tp 1'}")
    print(f"Sequential {seq:.1f} us per layer; LP period {tau:.1f} us: {seq / tau:.3f}x "
          f"(the ceiling, over every choice of forms: {top.gain:.3f}x {top.forms or ''})")
    near = beside(used)
    print(f"\n{'op':>14} {'class':>8} {'seq us':>7} {'W us':>7} {'LP us':>7}  beside (us)")
    for o in ops:
        runs = sum(near[o.op].values())
        partners = ", ".join(f"{k} {v:.0f}" for k, v in
                             sorted(near[o.op].items(), key=lambda kv: -kv[1]))
        print(f"{o.op:>14} {o.resource:>8} {seq_ops.get(o.op, 0):7.1f} {o.work_us:7.1f} "
              f"{runs:7.1f}  {partners}")
    print(f"\n{'us':>7}  mode (op option P)")
    for m in used:
        print(f"{m.us:7.1f}  {mode_text(m)}")
    busy = stream_busy(ops, used)
    print("\nbusy per layer: " + ", ".join(f"{k} {v:.0f} us ({v / tau:.0%})"
                                          for k, v in busy.items()))
    if args.nano_ops is not None:
        print(f"\nwith each op's nano-ops counted (MILP, at most {args.nano_ops:g} s a form):")
        groups = layer_graph(cfg.spec, cfg.tp).groups()
        for pick in itertools.product(*groups.values()):
            f = dict(zip(groups, pick, strict=True))
            t0 = time.perf_counter()
            period, how = nano_op_period(cfg, batch, f, args.nano_ops)
            lp_tau = solve_modes(form_ops(cfg, batch, f))[0]
            print(f"  forms {f or 'tp 1'}: LP {seq / lp_tau:.5f}x, nano-ops counted "
                  f"{seq / period:.5f}x ({how}, {time.perf_counter() - t0:.1f} s)")
    if args.json:
        data = {"profile": str(args.profile), "key": [d, t], "forms": forms,
                "sequential_us": seq, "period_us": tau, "gain": seq / tau,
                "ops": [{"op": o.op, "class": o.resource, "sequential_us": seq_ops.get(o.op),
                         "work_us": o.work_us, "beside": dict(near[o.op])} for o in ops],
                "modes": [{"us": m.us, "ops": list(m.ops),
                           "options": [option_text(o) for o in m.options]} for m in used]}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
