"""The elementwise Triton kernels on a bounded persistent grid, on a GPU at Llama-3-8B shapes
(hidden 4096, intermediate 14336, 32 q / 8 KV heads of 128) in bf16.

Run on a GPU machine: `python -m pytest -m gpu tests/gpu/test_elementwise_bounded_gpu.py`. Each
bound gives the torch reference's result (relative L2 error ≤ 1e-2), with and without
prefetching, and exactly the unbounded grid's bytes (a bound only changes which program handles
a row); the launch dict's bound reaches the kernels through dispatch on the whole GPU and on a
green-context partition; the bounded kernels replay from a CUDA graph on new inputs.
"""

from __future__ import annotations

import pytest
import torch

from nanosched.kernels import reference as ref
from nanosched.models.kvcache import KVCache
from nanosched.models.rope import rope_tables
from nanosched.models.spec import REGISTRY

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = REGISTRY["llama3-8b"]
HQ, HKV, HD, HID, INTER, PAGE = 32, 8, 128, 4096, 14336, 16
BF16 = torch.bfloat16
BOUNDS = [16, 32, 132]
ROWS = 1000  # not a multiple of any bound: programs get unequal row counts


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def randn(*shape: int, seed: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=gen).to(dtype)


class Case:
    """Inputs of the three ops at ROWS tokens, and fresh outputs for each run."""

    def __init__(self, seed: int = 0, kv_dtype: str = "auto") -> None:
        self.x, self.r = randn(ROWS, HID, seed=seed), randn(ROWS, HID, seed=seed + 1)
        self.w = randn(HID, seed=seed + 2)
        self.gu = randn(ROWS, 2 * INTER, seed=seed + 3)
        self.qkv = randn(ROWS, (HQ + 2 * HKV) * HD, seed=seed + 4)
        gen = torch.Generator(device="cuda").manual_seed(seed + 5)
        self.pos = torch.randint(0, SPEC.max_position_embeddings, (ROWS,), device="cuda",
                                 generator=gen)
        self.pages = 2 * ROWS // PAGE
        self.slots = torch.randperm(self.pages * PAGE, device="cuda", generator=gen)[:ROWS]
        self.cos, self.sin = rope_tables(SPEC, "cuda")
        self.kv_dtype = kv_dtype

    def run(self, norm, act, rope, **launch) -> dict[str, torch.Tensor]:
        """The three ops through the given functions; residual updated in place."""
        res = self.r.clone()
        out = {"norm": torch.empty_like(self.x), "act": torch.empty(ROWS, INTER, dtype=BF16,
                                                                   device="cuda"),
               "q": torch.empty(ROWS, HQ, HD, dtype=BF16, device="cuda")}
        norm(self.x, res, self.w, 1e-5, out["norm"], res, **launch)
        act(self.gu, out["act"], **launch)
        kv = KVCache(1, self.pages, HKV, HD, BF16, "cuda", PAGE, kv_dtype=self.kv_dtype)
        layer = kv.layer(0)
        rope(self.qkv, self.pos, self.cos, self.sin, self.slots, layer.k, layer.v, out["q"],
             **layer.scales, **launch)
        out |= {"residual": res, "k": layer.k, "v": layer.v}
        if self.kv_dtype == "fp8":
            out |= {"k_scale": layer.k_scale, "v_scale": layer.v_scale}
        return out


def kernels():
    from nanosched.kernels.elementwise import rms_norm_add, rope_append, silu_mul

    return rms_norm_add, silu_mul, rope_append


def check_against_reference(case: Case, got: dict[str, torch.Tensor]) -> None:
    want = case.run(ref.rms_norm_add, ref.silu_mul, ref.rope_append)
    for name in ("norm", "residual", "act", "q"):
        assert rel_err(got[name], want[name]) <= 1e-2, name
    if case.kv_dtype == "fp8":  # the reference rotates k in bf16, the kernel in fp32, so a
        # few values round to a neighbouring e4m3 value (each e4m3 value is within 2^-4)
        for cache, scale in (("k", "k_scale"), ("v", "v_scale")):
            assert rel_err(ref.dequantize(got[cache], got[scale]),
                           ref.dequantize(want[cache], want[scale])) <= 6e-2, cache
    else:
        assert rel_err(got["k"], want["k"]) <= 1e-2 and rel_err(got["v"], want["v"]) <= 1e-2


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("max_ctas", BOUNDS)
def test_bounded_kernels_equal_the_reference_and_the_unbounded_grid(max_ctas, kv_dtype):
    case = Case(kv_dtype=kv_dtype)
    whole = case.run(*kernels())
    check_against_reference(case, whole)
    got = case.run(*kernels(), max_ctas=max_ctas)  # the same binary: the same bytes
    for name, tensor in whole.items():
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
    for prefetch in (True, False):  # each kernel's default and the other setting
        check_against_reference(case, case.run(*kernels(), max_ctas=max_ctas, prefetch=prefetch))


def test_launch_dict_bounds_through_dispatch_on_all_sms_and_on_a_partition():
    from nanosched.greenctx import split_sms
    from nanosched.kernels import dispatch as K

    opts = K.KernelOptions()
    ops = (lambda *a, **k: K.rms_norm_add(*a[:6], opts, k["launch"]),
           lambda *a, **k: K.silu_mul(*a, opts, k["launch"]),
           lambda *a, **k: K.rope_append(*a[:8], opts, k["launch"], k_scale=k.get("k_scale"),
                                         v_scale=k.get("v_scale")))
    case = Case(seed=10, kv_dtype="fp8")
    whole = case.run(*kernels())
    for launch in ({"impl": "triton", "max_ctas": 16}, {"impl": "triton", "num_sms": 132}):
        got = case.run(*ops, launch=launch)
        for name, tensor in whole.items():
            assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
    pair = split_sms(0, 16)
    try:
        with torch.cuda.stream(pair.small.stream):
            got = case.run(*ops, launch={"impl": "triton", "num_sms": pair.small.sms,
                                         "partition": True})
        pair.small.stream.synchronize()
    finally:
        pair.close()
    for name, tensor in whole.items():
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_bounded_kernels_replay_from_a_cuda_graph():
    """Captured with 16 programs each, replayed on new inputs: the eager unbounded result of
    those inputs each time."""
    static = Case(seed=20)
    norm, act, rope = kernels()
    res = static.r.clone()
    out = {"norm": torch.empty_like(static.x),
           "act": torch.empty(ROWS, INTER, dtype=BF16, device="cuda"),
           "q": torch.empty(ROWS, HQ, HD, dtype=BF16, device="cuda")}
    layer = KVCache(1, static.pages, HKV, HD, BF16, "cuda", PAGE).layer(0)

    def step() -> None:
        norm(static.x, res, static.w, 1e-5, out["norm"], res, max_ctas=16)
        act(static.gu, out["act"], max_ctas=16)
        rope(static.qkv, static.pos, static.cos, static.sin, static.slots, layer.k, layer.v,
             out["q"], max_ctas=16)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (30, 40):
        new = Case(seed=seed)
        for name in ("x", "w", "gu", "qkv", "pos", "slots"):
            getattr(static, name).copy_(getattr(new, name))
        res.copy_(new.r)
        layer.k.zero_()
        layer.v.zero_()
        graph.replay()
        want = new.run(*kernels())
        for name in ("norm", "act", "q"):
            assert torch.equal(out[name], want[name]), (seed, name)
        assert torch.equal(res, want["residual"]), seed
        assert torch.equal(layer.k, want["k"]) and torch.equal(layer.v, want["v"]), seed
