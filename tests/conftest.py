"""Test-wide setup: one torch thread, Triton's CPU interpreter on machines without a GPU, and
GPU tests only when asked for.

TRITON_INTERPRET must be set before triton is first imported; nanosched imports triton lazily
and this file runs before any test module, so setting it here covers every test. On a GPU
machine it stays unset and the Triton kernels compile for the GPU (tests/gpu/).

Tests marked `gpu` run only under a `-m` expression that names `gpu` (`-m gpu tests/gpu`);
without one, or under any other (`-m "not slow"`, the edit loop), they are deselected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The CPU tests' tensors are tiny: a second intra-op thread only adds synchronisation,
    # which on a busy 2-core machine made them 3-4x slower, in wall and in CPU time. Processes
    # the tests spawn (servers, tp ranks) inherit the variable.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if "gpu" in (config.getoption("markexpr") or ""):
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
