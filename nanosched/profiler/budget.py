"""How long the parts of a profile take, so a run can stop at a time limit and be resumed.

Pure Python. A GPU lent for at most so many minutes per command (10 on the project's device
machines) takes a full grid in parts: `nanosched profile --time-limit S` measures until the
next piece would not fit in the S seconds since the command started, saves the partial file
and stops (exit 75); `--resume --time-limit S` goes on, and the call that finishes writes the
profile. The estimates only decide where to stop, so they are generous:
- a kernel row: well under a second, but the first of an op may compile its kernels
  (`ROW_MARGIN_S` kept free);
- a looped piece (pair, alone reference, forward layer): `pair_settle_ms + pair_window_ms`;
  a memory pair may first need both sides' alone references, so three of them;
- the network step runs in batches of GEMM x all-reduce pairs, each batch one start of the
  ranks (`NETWORK_START_S`: spawning them, NCCL's groups, the copy engine's mapped buffers),
  the collective rows in the first batch (`COLLECTIVE_S` each), each new GEMM shape's alone
  run, and each pair: its collective is launched as many times as fill the window at its own
  alone rate, so beside a GEMM it lasts the window / its P; `PAIR_P` is below the lowest P
  against its own row the 4xH100 quick profile measured (NCCL unbounded 0.26, bounded 0.46,
  copy engine 0.57: pairs of 1.3 to 5 s).
A batch holds at most `MAX_BATCH_S` of estimated work, under the workers' own timeout, and at
least `MIN_BATCH_PAIRS` pairs (or all that are left): fewer would not pay for the start.
"""

from __future__ import annotations

from nanosched.kernels.impls import network_impl
from nanosched.profiler.plan import PairTask, ProfileSettings

ROW_MARGIN_S = 15.0
NETWORK_START_S = 45.0
COLLECTIVE_S = 0.15
PAIR_OVERHEAD_S = 0.5  # capturing the collective's graph, setting up the GEMM
PAIR_P = {"nccl": 0.2, "nccl_bounded": 0.4, "copy_engine": 0.45}
MAX_BATCH_S = 420.0
MIN_BATCH_PAIRS = 8  # fewer (unless that is all that is left) do not pay for a start


def looped_s(settings: ProfileSettings) -> float:
    """One looped piece: the clock's settle time and the timed window."""
    return (settings.pair_settle_ms + settings.pair_window_ms) / 1e3


def network_pair_s(settings: ProfileSettings, task: PairTask) -> float:
    kind, ctas = network_impl(task.other_impl)
    p = PAIR_P["nccl_bounded" if kind == "nccl" and ctas else kind]
    return looped_s(settings) / p + PAIR_OVERHEAD_S


def network_batch(settings: ProfileSettings, todo: list[PairTask], num_collectives: int,
                  budget_s: float) -> tuple[list[PairTask], float]:
    """The longest prefix of `todo` whose batch fits `budget_s` (and `MAX_BATCH_S`), with its
    estimate; `num_collectives` rows to time first (0: known). An empty list: too little fits
    (fewer than `MIN_BATCH_PAIRS` pairs of more, or not even the start and the collectives when
    no pair is left)."""
    budget = min(budget_s, MAX_BATCH_S)
    cost = NETWORK_START_S + COLLECTIVE_S * num_collectives
    shapes: set[tuple[str, int]] = set()
    batch: list[PairTask] = []
    for task in todo:
        more = network_pair_s(settings, task)
        if (task.compute_op, task.tokens) not in shapes:
            more += looped_s(settings)
        if cost + more > budget:
            break
        cost += more
        shapes.add((task.compute_op, task.tokens))
        batch.append(task)
    if len(batch) < min(len(todo), MIN_BATCH_PAIRS):
        return [], cost
    return batch, cost


def network_collectives(tokens: int, ctas: int, copy_engine_ctas: int) -> int:
    """How many collective rows a network step times (3 NCCL kinds, the copy engine)."""
    return tokens * (3 * ctas + copy_engine_ctas)
