"""The narrow W8A8 grouped GEMM (kernels/grouped_narrow.py) against `reference.grouped_linear_fp8`
on CPU through TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU): small shapes and a
small chunk (max_rows), so that every piece count and the chunk loop run in a few seconds."""

from __future__ import annotations

import os

import pytest
import torch

from nanosched.errors import ConfigError
from nanosched.kernels import dispatch
from nanosched.kernels import reference as ref
from nanosched.kernels.dispatch import KernelOptions, triton_available

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="needs triton and TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")

E, N, K = 6, 40, 80  # N no multiple of block_n 16 or 32, K none of block_k 32
# rows an expert: none, one, 37 (no multiple of a 16-row piece: 3 pieces, dots of 32 + 16),
# 70 (over a 64-row chunk: 64 + 6), 16 (one whole piece), 130 (a whole 128-row chunk, 8 pieces
# in one dot, and 2 rows)
COUNTS = (0, 1, 37, 70, 16, 130)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def problem(gathered: bool, seed: int = 0):
    """e4m3 x (one row a token when gathered, read by x_rows; else one a routed row), experts,
    shuffled expert ids of COUNTS, and the emulation's out."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(COUNTS)])
    ids = ids[torch.randperm(len(ids), generator=gen)]
    m = len(ids)
    x_rows = torch.randint(0, 50, (m,), generator=gen) if gathered else None
    x8, xs = ref.quantize_fp8(torch.randn(50 if gathered else m, K, generator=gen))
    w8, ws = ref.quantize_fp8(torch.randn(E, N, K, generator=gen) / 8)  # scales [E, N]
    want = torch.empty(m, N)
    ref.grouped_linear_fp8(x8, xs, w8, ws, ids, x_rows, want)
    return x8, xs, w8, ws, ids, x_rows, want


@pytest.mark.parametrize("gathered", [True, False])
@pytest.mark.parametrize("block_n, piece, max_rows, split", [(16, 16, 64, 1), (32, 16, 128, 2),
                                                              (32, 32, 32, 1), (16, 16, 16, 3)])
def test_grouped_narrow_is_the_exact_emulation(gathered, block_n, piece, max_rows, split):
    """Every expert's rows, whatever their count (none, one, a piece's fraction, more than a
    chunk), to fp32 rounding; written into a row slice of a larger buffer and nowhere else."""
    from nanosched.kernels.grouped_narrow import GroupedNarrowConfig, grouped_narrow_fp8

    x8, xs, w8, ws, ids, x_rows, want = problem(gathered)
    m = len(ids)
    buf = torch.full((m + 3, N), float("nan"))
    out = buf[1:m + 1]
    cfg = GroupedNarrowConfig(block_n=block_n, block_k=32, piece=piece, max_rows=max_rows,
                              split_k=split)
    grouped_narrow_fp8(x8, xs, w8, ws, ids, x_rows, out, cfg)
    assert rel_err(out, want) < 1e-5
    assert buf[0].isnan().all() and buf[m + 1:].isnan().all()


def test_grouped_narrow_of_few_rows_and_none():
    """Fewer rows than experts (most experts without rows), and no rows at all."""
    from nanosched.kernels.grouped_narrow import GroupedNarrowConfig, grouped_narrow_fp8

    gen = torch.Generator().manual_seed(1)
    x8, xs = ref.quantize_fp8(torch.randn(3, 32, generator=gen))
    w8, ws = ref.quantize_fp8(torch.randn(8, 24, 32, generator=gen))
    ids, rows = torch.tensor([7, 2]), torch.tensor([2, 0])
    want, got = torch.empty(2, 24), torch.full((2, 24), float("nan"))
    ref.grouped_linear_fp8(x8, xs, w8, ws, ids, rows, want)
    grouped_narrow_fp8(x8, xs, w8, ws, ids, rows, got, GroupedNarrowConfig(block_n=16,
                                                                           block_k=32))
    assert rel_err(got, want) < 1e-5
    grouped_narrow_fp8(x8, xs, w8, ws, ids[:0], None, got[:0])  # nothing to launch


def test_grouped_narrow_refuses_what_it_cannot_compute():
    from nanosched.kernels.grouped_narrow import GroupedNarrowConfig, grouped_narrow_fp8

    x8, xs, w8, ws, ids, x_rows, want = problem(gathered=False)
    with pytest.raises(ConfigError, match=r"x_scale must be \[254\] and w_scale \[6, 40\]"):
        grouped_narrow_fp8(x8, xs, w8, ws[0], ids, x_rows, want)
    with pytest.raises(ConfigError, match=r"out \[254, 39\] do not fit"):
        grouped_narrow_fp8(x8, xs, w8, ws, ids, x_rows, want[:, :39])
    with pytest.raises(ConfigError, match="out along N"):
        grouped_narrow_fp8(x8, xs, w8, ws, ids, x_rows, torch.empty(N, len(ids)).t())
    for piece, max_rows in ((24, 48), (8, 16), (16, 24), (16, 144)):
        with pytest.raises(ConfigError, match="power of two"):
            GroupedNarrowConfig(piece=piece, max_rows=max_rows)


@pytest.mark.parametrize("gathered", [True, False])
def test_dispatch_runs_it_where_a_launch_names_it(gathered, monkeypatch):
    """`triton_narrow` in a launch runs it (its default launch); the default stays the row-tiled
    Triton grouped GEMM; the bf16 grouped GEMM refuses the name."""
    x8, xs, w8, ws, ids, x_rows, want = problem(gathered, seed=2)
    got = torch.full_like(want, float("nan"))
    opts = KernelOptions(backend="triton")
    dispatch.grouped_linear_fp8(x8, xs, w8, ws, ids, x_rows, got, opts,
                                {"impl": dispatch.NARROW})
    assert rel_err(got, want) < 1e-5
    from nanosched.kernels import grouped_narrow

    monkeypatch.setattr(grouped_narrow, "grouped_narrow_fp8", None)  # the default must not call it
    default = torch.full_like(want, float("nan"))
    dispatch.grouped_linear_fp8(x8, xs, w8, ws, ids, x_rows, default, opts)
    assert rel_err(default, want) < 1e-5
    with pytest.raises(ConfigError, match="triton_narrow is the W8A8 grouped GEMM only"):
        dispatch.grouped_linear(want, want.view(1, *want.shape), ids, None, got, opts,
                                {"impl": dispatch.NARROW})
    with pytest.raises(ConfigError, match="'triton_narrow_x' is unknown for grouped"):
        dispatch.grouped_linear_fp8(x8, xs, w8, ws, ids, x_rows, got, opts,
                                    {"impl": "triton_narrow_x"})
