"""A profile taken in time-limited parts (`--time-limit`, `--resume`) on a fake GPU whose clock
counts the work done: each part stops inside its limit, the network pairs go in several
batches, and the parts together write the profile one run writes. The budget's batches and
the network pairs of the full tp = 4 grid (1,024-row GEMMs included)."""

from __future__ import annotations

import pytest

from nanosched.models.spec import load_spec
from nanosched.profiler.budget import (
    MAX_BATCH_S,
    MIN_BATCH_PAIRS,
    NETWORK_START_S,
    network_batch,
)
from nanosched.profiler.fake import FakeBackend
from nanosched.profiler.plan import ProfileSettings, network_pair_tasks
from nanosched.profiler.runner import ProfileStopped, RunOptions, run_profile
from nanosched.workloads import fixed

LIMIT_S = 200.0


def _settings(quick: bool = False) -> ProfileSettings:
    return ProfileSettings(load_spec("llama3-8b"), 2, fixed(1024, 512), 256, quick)


def test_parts_each_within_the_limit_write_the_profile_one_run_writes(tmp_path):
    s = _settings()
    whole = run_profile(s, FakeBackend(gpus=2), RunOptions(tmp_path / "whole.json",
                                                           progress=False, log=lambda _: None))
    logs: list[str] = []
    batches, parts = [], 0
    while True:
        backend = FakeBackend(gpus=2)
        opts = RunOptions(tmp_path / "p.json", resume=parts > 0, progress=False,
                          log=logs.append, clock=backend.clock, deadline=LIMIT_S)
        parts += 1
        try:
            prof = run_profile(s, backend, opts)
        except ProfileStopped as stop:
            assert "continue with" in str(stop)
            continue
        finally:
            assert backend.clock() <= LIMIT_S, (parts, backend.clock())
            batches += [len(r.pairs) for r in backend.network_calls]
            assert parts < 20
        break
    assert parts >= 3 and len(batches) >= 2 and sum(batches) == len(
        [p for p in whole.pairs if p.other_class == "network"])
    assert prof.kernels == whole.kernels and set(prof.pairs) == set(whole.pairs)
    assert prof.rp == whole.rp
    assert any(line.startswith("network: ") for line in logs)


def test_a_batch_is_the_prefix_that_fits_and_worth_its_start():
    s = _settings()
    tasks = network_pair_tasks(s, 132, FakeBackend().implementations()[0], (8, 16))
    batch, cost = network_batch(s, tasks, 10, 200.0)
    assert MIN_BATCH_PAIRS <= len(batch) < len(tasks) and batch == tasks[:len(batch)]
    assert cost <= 200.0
    assert network_batch(s, tasks, 10, 60.0)[0] == []  # fewer than MIN_BATCH_PAIRS would fit
    assert network_batch(s, tasks[:2], 0, 60.0)[0] == tasks[:2]  # all that is left
    assert network_batch(s, tasks, 0, 10.0) == ([], NETWORK_START_S)
    batch, cost = network_batch(s, tasks * 50, 0, float("inf"))
    assert cost <= MAX_BATCH_S and len(batch) < len(tasks) * 50


@pytest.mark.parametrize("quick", [True, False])
def test_network_pairs_of_the_tp4_grid_pair_1024_row_gemms(quick):
    """Llama-3-70B tp = 4 at dense batch 1,152: every pair shape and its GEMMs at 1,024 rows;
    per shape NCCL beside the fastest GEMM, NCCL bounded and the copy engine beside the fastest
    GEMM that can be told to leave the SMs."""
    s = ProfileSettings(load_spec("llama3-70b"), 4, fixed(1024, 512), 1152, quick)
    impls = FakeBackend().implementations()[0]

    def best(op, tokens, sms, mechanism, among=None):
        return "triton_persistent_128x128" if among else "cublas"

    tasks = network_pair_tasks(s, 132, impls, (8, 16), best)
    shapes = s.network_pair_shapes()
    assert {(op, 1024) for op, _ in s.pair_shapes()} <= set(shapes)
    assert len(tasks) == len(shapes) * (1 + len(s.nccl_ctas()) + 2)
    for t in tasks:
        if t.other_impl == "nccl":
            assert (t.compute_impl, t.compute_sms) == ("cublas", 132)
        else:
            assert t.compute_impl == "triton_persistent_128x128"
            assert t.compute_sms == 132 - t.other_sms
    if not quick:
        assert len(shapes) == 16 and len(tasks) == 128
