"""How long the parts of a profile take, so a run can stop at a time limit and be resumed.

Pure Python. `--time-limit S` measures until the next piece would not fit in the S seconds
since the command started, saves the partial file and stops (exit 75); `--resume` goes on. So
a full grid is taken in parts on a GPU lent for minutes per command. The estimates (rows,
looped pieces, network batches) only decide where to stop, so they are generous.

More in docs/profiler.md, module notes.
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
