"""GEMM implementations through `dispatch.linear` on a GPU, in bf16 at Llama-3-8B shapes:
cuBLASLt with an SM-count target and the persistent Triton GEMM against torch, the SM target
restored after each call and actually obeyed (`python -m pytest -m gpu tests/gpu`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanosched.kernels import dispatch as K
from nanosched.kernels import impls

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OPTS = K.KernelOptions()


def sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def inputs(t: int, k: int, n: int, bias: bool = False):
    gen = torch.Generator(device="cuda").manual_seed(t + n)
    x = torch.randn(t, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=gen).bfloat16() if bias else None
    return x, w, b


@pytest.mark.parametrize("t, k, n, bias", [(300, 4096, 6144, True), (512, 14336, 4096, False),
                                           (37, 4096, 28672, False)])
@pytest.mark.parametrize("impl, frac", [("cublas", 1.0), ("cublaslt", 0.75),
                                        ("cublaslt", 0.25), ("triton_persistent_128x128", 0.3),
                                        ("triton_persistent_128x256", 1.0),
                                        ("triton_persistent_64x128", 0.75)])
def test_linear_impls_match_torch_in_bf16(t, k, n, bias, impl, frac):
    if impl == "cublaslt" and impls.cublaslt_missing():
        pytest.skip(impls.cublaslt_missing())
    x, w, b = inputs(t, k, n, bias)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    lib, carve = torch.backends.cuda.preferred_blas_library(), \
        torch._C._get_sm_carveout_experimental()
    K.linear(x, w, b, out, OPTS, {"impl": impl, "num_sms": max(1, int(frac * sms()))})
    assert rel_err(out, want) < 1e-2
    assert torch.backends.cuda.preferred_blas_library() == lib  # restored after the call
    assert torch._C._get_sm_carveout_experimental() == carve


def test_cublaslt_scope_sets_and_restores_the_sm_target():
    if impls.cublaslt_missing():
        pytest.skip(impls.cublaslt_missing())
    before = torch._C._get_sm_carveout_experimental()
    with impls.cublaslt_sm_target(100, 132):
        assert torch._C._get_sm_carveout_experimental() == 32
    assert torch._C._get_sm_carveout_experimental() == before


def _time_us(fn) -> float:
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=20, rep=100)


@pytest.mark.parametrize("impl", ["cublaslt", "triton_persistent_128x128"])
def test_sm_target_bounds_a_large_gemm(impl):
    """A compute-bound GEMM told to use a quarter of the SMs takes well over twice as long."""
    if impl == "cublaslt" and impls.cublaslt_missing():
        pytest.skip(impls.cublaslt_missing())
    x, w, _ = inputs(4096, 4096, 8192)
    out = torch.empty(4096, 8192, device="cuda", dtype=torch.bfloat16)
    full = _time_us(lambda: K.linear(x, w, None, out, OPTS, {"impl": impl, "num_sms": sms()}))
    quarter = _time_us(lambda: K.linear(x, w, None, out, OPTS,
                                        {"impl": impl, "num_sms": sms() // 4}))
    assert quarter > 2.0 * full, (impl, full, quarter)
