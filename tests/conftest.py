"""Test-wide setup: one torch thread, Triton's CPU interpreter on machines without a GPU, GPU
tests only when asked for, and how pytest-xdist shares out the tests (`-n 2`).

TRITON_INTERPRET must be set before triton is first imported; nanosched imports triton lazily
and `pytest_configure` runs before any test module is imported, so setting it there covers every
test. On a GPU machine it stays unset and the Triton kernels compile for the GPU (tests/gpu/).
The xdist controller runs no test, so it skips this setup and never imports torch (2 s of CPU
while the workers start on the same cores).
`lib_patches.apply()` (tests/helpers) skips work typer's CliRunner and Triton's interpreter
repeat for nothing, in the same processes.

Tests marked `gpu` run only under a `-m` expression that names `gpu` (`-m gpu tests/gpu`);
without one, or under any other (`-m "not slow"`, the edit loop), they are deselected.

Under pytest-xdist (`-n 2`, the README's command) the workers steal work: each starts on one
contiguous half of the tests, so a module's fixtures are mostly built once, and a worker that runs
out takes half of what the other has left. `shared_cache` is a folder every worker of one run
sees, for results computed once per run (tests/helpers/run_cache.py).
"""

import os
from pathlib import Path

import lib_patches
import pytest


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return  # the xdist controller: its workers run the tests
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # The CPU tests' tensors are tiny: a second intra-op thread only adds synchronisation,
        # which on a busy 2-core machine made them 3-4x slower, in wall and in CPU time.
        # Processes the tests spawn (servers, tp ranks) inherit the variable.
        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    lib_patches.apply()


def pytest_collection_modifyitems(config, items):
    if "gpu" in (config.getoption("markexpr") or ""):
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it is installed
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "load":  # what -n alone gives; loadfile, loadgroup... kept
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this run that every xdist worker shares (the parent of the workers' own
    temporary folders; pytest removes it with its old runs), or this process's own without one."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / "shared"
    folder.mkdir(exist_ok=True)
    return folder
