"""Every Triton kernel against its torch reference, on CPU through TRITON_INTERPRET=1.

Small shapes, fp32 and fp16 only (bf16 loads give garbage in the interpreter). tests/conftest.py
sets TRITON_INTERPRET=1 on machines without a GPU; with a GPU these are covered by tests/gpu/.
"""

from __future__ import annotations

import os

import pytest
import torch
from hf_models import make_hf

from nanosched.errors import ConfigError
from nanosched.kernels import reference as ref
from nanosched.kernels.common import PAGED, PIPELINED, PIPELINED_2W, DecodeConfig
from nanosched.kernels.dispatch import KernelOptions, triton_available

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="needs triton and TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")

DTYPES = [torch.float32, torch.float16]
# the shipped decode-attention configurations, and a deeper pipeline of small steps
DECODE_CONFIGS = [PAGED, PIPELINED, PIPELINED_2W, DecodeConfig(16, 5, 4, 1)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_ctas, num_splits", [(3, None), (2, 1), (16, 3)])
@pytest.mark.parametrize("config", DECODE_CONFIGS)
def test_decode_attention(dtype, max_ctas, num_splits, config):
    from nanosched.kernels.decode_attn import decode_attention

    gen = torch.Generator().manual_seed(0)
    pages, page, hkv, group, d = 24, 16, 2, 4, 32
    kc = torch.randn(pages, page, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(pages, page, hkv, d, generator=gen).to(dtype)
    # one token; one past a page; seven pages, the last partly filled; four pages exactly
    lens = torch.tensor([1, 17, 100, 64], dtype=torch.int32)
    tables = torch.stack([torch.randperm(pages, generator=gen)[:7] for _ in lens]).int()
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype)
    want, got = torch.empty_like(q), torch.full_like(q, float("nan"))
    ref.decode_attention(q, kc, vc, tables, lens, 100, d ** -0.5, want)
    decode_attention(q, kc, vc, tables, lens, 100, d ** -0.5, got, max_ctas=max_ctas,
                     num_splits=num_splits, config=config)
    assert rel_err(got, want) < tol(dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("config", DECODE_CONFIGS)
def test_decode_attention_padded_rows_are_zero_and_read_no_page(num_splits, config):
    """Rows of context length 0 (a CUDA-graph bucket's padding, block tables pointing far past
    the cache) come out zero, not NaN; the real rows are unchanged."""
    from nanosched.kernels.decode_attn import decode_attention

    gen = torch.Generator().manual_seed(3)
    pages, page, hkv, group, d = 12, 16, 2, 2, 32
    kc = torch.randn(pages, page, hkv, d, generator=gen)
    vc = torch.randn(pages, page, hkv, d, generator=gen)
    lens = torch.tensor([40, 0, 90, 0], dtype=torch.int32)
    tables = torch.stack([torch.randperm(pages, generator=gen)[:6] for _ in lens]).int()
    tables[lens == 0] = 10 ** 6  # would fault if read
    q = torch.randn(len(lens), hkv * group, d, generator=gen)
    got = torch.full_like(q, float("nan"))
    real = lens > 0
    want = torch.empty_like(q[real])
    ref.decode_attention(q[real], kc, vc, tables[real], lens[real], 90, d ** -0.5, want)
    decode_attention(q, kc, vc, tables, lens, 96, d ** -0.5, got, max_ctas=4,
                     num_splits=num_splits, config=config)
    assert torch.all(got[~real] == 0)
    assert rel_err(got[real], want) < tol(torch.float32)


@pytest.mark.parametrize("heads, splits, d, max_ctas", [(6, 3, 32, 2), (32, 2, 128, 5),
                                                        (5, 40, 128, 3)])
def test_merge_splits_weights_partials_by_their_lse(heads, splits, d, max_ctas):
    """merge_splits over blocks of heads (6 heads in one masked block of 8; 32 heads in two of
    16; 40 splits, one head a block): each head's partials weighted by softmax of their LSE, a
    head whose splits are all empty (-inf) zero."""
    from nanosched.kernels.decode_attn import merge_splits

    gen = torch.Generator().manual_seed(7)
    part = torch.randn(3, heads, splits, d, generator=gen)
    lse = torch.randn(3, heads, splits, generator=gen) * 4
    lse[1, 2] = float("-inf")
    lse[2, 0, 1:] = float("-inf")
    out = torch.full((3, heads, d), float("nan"))
    merge_splits(part, lse, out, max_ctas)
    weight = torch.softmax(lse, dim=-1).nan_to_num(0.0)
    want = (part * weight[..., None]).sum(2)
    assert torch.all(out[1, 2] == 0) and torch.equal(out[2, 0], part[2, 0, 0])
    assert rel_err(out, want) < 1e-6


def test_merge_splits_with_a_second_set_is_the_merge_of_both():
    """`more`: a second kernel's splits of the same rows (other strides, other count) merge as
    if appended to the first set's; mismatched rows are refused."""
    from nanosched.kernels.decode_attn import merge_splits

    gen = torch.Generator().manual_seed(8)
    part = torch.randn(4, 6, 3, 32, generator=gen)
    lse = torch.randn(4, 6, 3, generator=gen) * 3
    part2 = torch.randn(4, 6, 2, 32, generator=gen)
    lse2 = torch.randn(4, 6, 2, generator=gen) * 3
    lse2[0, 1] = float("-inf")
    got, want = torch.empty(4, 6, 32), torch.empty(4, 6, 32)
    merge_splits(part[:, :, :2], lse[:, :, :2], got, 3, more=(part2, lse2))
    merge_splits(torch.cat([part[:, :, :2], part2], 2), torch.cat([lse[:, :, :2], lse2], 2),
                 want, 3)
    assert rel_err(got, want) < 1e-6
    with pytest.raises(ConfigError, match="second set's part"):
        merge_splits(part, lse, got, 3, more=(part2[:3], lse2[:3]))


# (max_ctas, prefetch): one program per item, then persistent grids smaller than the items
BOUNDS = [(None, True), (1, True), (3, True), (3, False)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("max_ctas, prefetch", BOUNDS)
def test_rms_norm_add(dtype, with_residual, max_ctas, prefetch):
    from nanosched.kernels.elementwise import rms_norm_add

    gen = torch.Generator().manual_seed(1)
    x, r = (torch.randn(5, 48, generator=gen).to(dtype) for _ in range(2))
    w = torch.rand(48, generator=gen).to(dtype) + 0.5
    res = r if with_residual else None
    want, want_r = torch.empty_like(x), torch.empty_like(x)
    got, got_r = torch.empty_like(x), torch.empty_like(x)
    ref.rms_norm_add(x, res, w, 1e-5, want, want_r)
    rms_norm_add(x, res, w, 1e-5, got, got_r, max_ctas=max_ctas, prefetch=prefetch)
    assert rel_err(got, want) < tol(dtype) and rel_err(got_r, want_r) < tol(dtype)


@pytest.mark.parametrize("max_ctas", [None, 2])
def test_rms_norm_add_updates_the_residual_in_place(max_ctas):
    """residual_out aliasing residual (the model's layout): a program's next row is loaded
    before this row's residual is stored, and rows never overlap."""
    from nanosched.kernels.elementwise import rms_norm_add

    gen = torch.Generator().manual_seed(11)
    buf = torch.randn(9, 40, generator=gen)  # rows 1..7 of a larger buffer
    x, w = torch.randn(7, 40, generator=gen), torch.rand(40, generator=gen) + 0.5
    want, want_r = torch.empty_like(x), torch.empty_like(x)
    ref.rms_norm_add(x, buf[1:8], w, 1e-5, want, want_r)
    got, outside = torch.empty_like(x), buf[[0, 8]].clone()
    rms_norm_add(x, buf[1:8], w, 1e-5, got, buf[1:8], max_ctas=max_ctas)
    assert rel_err(got, want) < 1e-5 and rel_err(buf[1:8], want_r) < 1e-5
    assert torch.equal(buf[[0, 8]], outside)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(6, 40), (3, 2088)])  # 1 and 2 items per row
@pytest.mark.parametrize("max_ctas, prefetch", BOUNDS)
def test_silu_mul(dtype, rows, inter, max_ctas, prefetch):
    from nanosched.kernels.elementwise import silu_mul

    gu = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(2)).to(dtype)
    want, got = torch.empty(rows, inter, dtype=dtype), torch.empty(rows, inter, dtype=dtype)
    ref.silu_mul(gu, want)
    silu_mul(gu, got, max_ctas=max_ctas, prefetch=prefetch)
    assert rel_err(got, want) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv", [(4, 2), (6, 3)])  # 6 and 3: heads masked in the tiles
@pytest.mark.parametrize("max_ctas, prefetch", BOUNDS)
def test_rope_append(dtype, hq, hkv, max_ctas, prefetch):
    from nanosched.kernels.elementwise import rope_append

    gen = torch.Generator().manual_seed(3)
    d, pages, page = 16, 6, 4
    qkv = torch.randn(5, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    pos, slots = torch.tensor([0, 3, 7, 100, 5]), torch.tensor([1, 9, 23, 3, 12])
    freqs = torch.outer(torch.arange(128).float(), 1 / 500.0 ** (torch.arange(0, d, 2) / d))
    outs = []
    for fn, bound in ((ref.rope_append, {}), (rope_append, {"max_ctas": max_ctas,
                                                            "prefetch": prefetch})):
        k, v = torch.zeros(pages, page, hkv, d, dtype=dtype), torch.zeros(pages, page, hkv, d,
                                                                         dtype=dtype)
        q = torch.empty(5, hq, d, dtype=dtype)
        fn(qkv, pos, freqs.cos(), freqs.sin(), slots, k, v, q, **bound)
        outs.append((q, k, v))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert rel_err(got, want) < tol(dtype)
    assert outs[1][2].view(-1, hkv, d)[9].abs().sum() > 0  # V written at token 1's slot
    assert torch.equal(outs[1][1].view(-1, hkv, d)[0], torch.zeros(hkv, d))  # no stray slot


class GridLog:
    """Records the grid of every launch of an elementwise Triton kernel (monkeypatched)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
        from nanosched.kernels import elementwise

        self.grids: dict[str, list[tuple[int, ...]]] = {name: [] for name in names}
        for name in names:
            monkeypatch.setattr(elementwise, name, self._wrap(name, getattr(elementwise, name)))

    def _wrap(self, name: str, kernel):
        log = self.grids[name]

        class Launcher:
            def __getitem__(self, grid):
                log.append(tuple(grid))
                return kernel[grid]

        return Launcher()


def test_elementwise_grid_is_the_bound_or_one_program_per_item(monkeypatch):
    from nanosched.kernels import elementwise as E

    log = GridLog(monkeypatch, "_rms_norm_add_kernel", "_silu_mul_kernel", "_rope_append_kernel")
    x = torch.randn(5, 48)
    gu = torch.randn(3, 2 * (E.SILU_BLOCK + 40))  # 2 items per row
    qkv, pos, slots = torch.randn(5, 8 * 16), torch.arange(5), torch.arange(5)
    table = torch.rand(8, 8)
    for bound in (None, 2, 100):
        E.rms_norm_add(x, None, torch.ones(48), 1e-5, torch.empty_like(x), torch.empty_like(x),
                       max_ctas=bound)
        E.silu_mul(gu, torch.empty(3, E.SILU_BLOCK + 40), max_ctas=bound)
        E.rope_append(qkv, pos, table, table, slots, torch.zeros(2, 4, 2, 16),
                      torch.zeros(2, 4, 2, 16), torch.empty(5, 4, 16), max_ctas=bound)
    assert log.grids == {"_rms_norm_add_kernel": [(5,), (2,), (5,)],
                         "_silu_mul_kernel": [(6,), (2,), (6,)],
                         "_rope_append_kernel": [(5,), (2,), (5,)]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_sms, bias", [(1, False), (3, True)])
def test_persistent_gemm(dtype, num_sms, bias):
    from nanosched.kernels.gemm import GemmConfig, persistent_linear

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, 50, generator=gen).to(dtype)
    w = torch.randn(70, 50, generator=gen).to(dtype)
    b = torch.randn(70, generator=gen).to(dtype) if bias else None
    want = x.float() @ w.float().t() + (b.float() if bias else 0)
    out = torch.empty(40, 70, dtype=dtype)[2:39]  # a row slice of a larger buffer
    cfg = GemmConfig(num_sms=num_sms, block_m=16, block_n=32, block_k=16, group_m=2)
    persistent_linear(x, w, b, out, cfg)
    assert rel_err(out, want) < tol(dtype)


@pytest.mark.parametrize("bias", [False, True])
def test_persistent_gemm_fp8_is_the_exact_emulation(bias):
    """W8A8 through the persistent GEMM: e4m3 rows and weights, a scale per row and per output
    channel, the sums in fp32: what `reference.linear_fp8` computes, to fp32 rounding."""
    from nanosched.kernels.gemm import GemmConfig, persistent_linear

    gen = torch.Generator().manual_seed(5)
    x8, xs = ref.quantize_fp8(torch.randn(37, 64, generator=gen))
    w8, ws = ref.quantize_fp8(torch.randn(70, 64, generator=gen))
    b = torch.randn(70, generator=gen) if bias else None
    want, out = torch.empty(37, 70), torch.empty(37, 70)
    ref.linear_fp8(x8, xs, w8, ws, b, want)
    persistent_linear(x8, w8, b, out, GemmConfig(num_sms=3, block_m=16, block_n=32,
                                                 block_k=32, group_m=2), xs, ws)
    assert rel_err(out, want) < 1e-5
    with pytest.raises(ValueError, match="x_scale and w_scale"):
        persistent_linear(x8, w8, b, out, None, xs, None)
    # the dispatcher runs it where a launch names the persistent GEMM
    from nanosched.kernels import dispatch
    from nanosched.kernels.impls import persistent_name

    got = torch.empty(37, 70)
    dispatch.linear_fp8(x8, xs, w8, ws, b, got, dispatch.KernelOptions(),
                        {"impl": persistent_name(16, 32), "num_sms": 2})
    assert rel_err(got, want) < 1e-5



def test_grouped_tile_schedule_is_sorted_rows_and_tile_counts():
    from nanosched.kernels.grouped_gemm import tile_schedule

    sched = tile_schedule(torch.tensor([2, 0, 2, 2, 4, 0]), num_experts=5, block_m=2)
    assert sched.perm.tolist() == [1, 5, 0, 2, 3, 4]  # stable: ties keep their order
    assert sched.offsets.tolist() == [0, 2, 2, 5, 5, 6]  # experts 1 and 3 have no rows
    assert sched.tile_end.tolist() == [1, 1, 3, 3, 4]  # ceil(count / 2) tiles each
    assert sched.max_m_tiles == 6 // 2 + 5


def top2_routing(num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Expert ids [num_tokens * 2] of a skewed top-2 over 5 experts: expert 0 takes more than two
    16-row tiles, expert 3 none."""
    scores = torch.randn(num_tokens, 5, generator=gen) + torch.tensor([3.0, 0, 0, -1e9, 0])
    ids = scores.topk(2, dim=-1).indices.flatten()
    counts = torch.bincount(ids, minlength=5)
    assert counts[3] == 0 and counts[0] > 32 and counts.tolist() != sorted(counts.tolist())
    return ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles, num_programs", [((16, 32, 16, 2), None), ((16, 16, 32, 1), 3),
                                                 ((32, 64, 16, 8), 1)])
def test_grouped_gemm(dtype, tiles, num_programs):
    from nanosched.kernels.grouped_gemm import GroupedGemmConfig, grouped_linear

    gen = torch.Generator().manual_seed(7)
    tokens, k_in, n_out = 37, 40, 50
    ids = top2_routing(tokens, gen)
    x = torch.randn(tokens, 2 * k_in, generator=gen).to(dtype)[:, 3:3 + k_in]  # strided view
    w = torch.randn(5, n_out, k_in, generator=gen).to(dtype)
    bm, bn, bk, gm = tiles
    cfg = GroupedGemmConfig(num_programs=num_programs, block_m=bm, block_n=bn, block_k=bk,
                            group_m=gm)
    for x_rows in (torch.arange(tokens).repeat_interleave(2), None):  # gate_up, then down
        rows_x = x if x_rows is not None else torch.randn(2 * tokens, k_in, generator=gen).to(dtype)
        want = torch.empty(2 * tokens, n_out)
        ref.grouped_linear(rows_x.float(), w.float(), ids, x_rows, want)
        buf = torch.full((2 * tokens + 4, n_out + 9), float("nan"), dtype=dtype)
        out = buf[3:3 + 2 * tokens, 5:5 + n_out]  # a strided slice of a larger buffer
        grouped_linear(rows_x, w, ids, x_rows, out, cfg)
        assert rel_err(out, want) < tol(dtype)
        outside = buf.clone()
        outside[3:3 + 2 * tokens, 5:5 + n_out] = float("nan")
        assert outside.isnan().all()  # nothing written outside the slice


def test_grouped_gemm_with_fewer_rows_than_experts_and_none():
    from nanosched.kernels.grouped_gemm import GroupedGemmConfig, grouped_linear

    gen = torch.Generator().manual_seed(8)
    x, w = torch.randn(3, 16, generator=gen), torch.randn(6, 24, 16, generator=gen)
    ids = torch.tensor([5, 1])
    want, got = torch.empty(2, 24), torch.full((2, 24), float("nan"))
    ref.grouped_linear(x, w, ids, torch.tensor([2, 2]), want)
    grouped_linear(x, w, ids, torch.tensor([2, 2]), got, GroupedGemmConfig(block_m=16))
    assert rel_err(got, want) < 1e-5
    grouped_linear(x, w, ids[:0], None, got[:0])  # no rows: nothing to launch
    with pytest.raises(ConfigError, match=r"out \[2, 23\] do not fit"):
        grouped_linear(x, w, ids, None, torch.empty(2, 23))

@pytest.mark.slow
def test_model_on_triton_kernels_matches_torch(tmp_path):
    """The whole tiny model through the Triton kernels (interpreted) equals the torch path."""
    from nanosched.models.checkpoint import load_checkpoint
    from nanosched.models.model import CausalLM
    from nanosched.models.spec import load_spec

    make_hf("llama", tmp_path, seed=5, num_hidden_layers=1)
    logits = []
    for opts in (KernelOptions("torch"), KernelOptions("triton", gemm="triton")):
        model = CausalLM(load_spec(str(tmp_path)), kernels=opts)
        load_checkpoint(model, tmp_path)
        ws = model.new_workspace(16, 6)
        ws.kv.plan([(0, 6, False)])
        meta = ws.kv.plan([(0, 1, True), (1, 9, False)])
        ws.kv.k.normal_(generator=torch.Generator().manual_seed(6))  # request 0's context
        ws.token_ids[:10] = torch.arange(10) * 3
        with torch.inference_mode():
            logits.append(model(ws, meta))
    assert rel_err(logits[1], logits[0]) < 1e-5


@pytest.mark.parametrize("rows,split", [(1, 1), (37, 3), (130, 1), (200, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_narrow_gemm_fp8_is_the_exact_emulation(rows, split, bias):
    """The decode-sized W8A8 GEMM (weights as the wide operand, rows in at most two pieces,
    K shared by `split` programs): what `reference.linear_fp8` computes, to fp32 rounding, into
    a row slice of a buffer; a K that is no multiple of its step and an N that is none of its
    block."""
    from nanosched.kernels.gemm_narrow import NarrowConfig, narrow_linear_fp8, pieces

    gen = torch.Generator().manual_seed(6)
    x8, xs = ref.quantize_fp8(torch.randn(rows, 80, generator=gen))
    w8, ws = ref.quantize_fp8(torch.randn(70, 80, generator=gen))
    b = torch.randn(70, generator=gen) if bias else None
    want, out = torch.empty(rows, 70), torch.full((rows + 3, 70), float("nan"))[1:rows + 1]
    ref.linear_fp8(x8, xs, w8, ws, b, want)
    narrow_linear_fp8(x8, xs, w8, ws, b, out, NarrowConfig(block_n=32, block_k=32,
                                                           split_k=split))
    assert rel_err(out, want) < 1e-5
    assert sum(pieces(rows)) < rows + 64
    with pytest.raises(ConfigError, match="x_scale"):
        narrow_linear_fp8(x8, ws, w8, ws, b, out)
    with pytest.raises(ConfigError, match="257"):
        pieces(257)
    from nanosched.kernels import dispatch

    got = torch.empty(rows, 70)
    dispatch.linear_fp8(x8, xs, w8, ws, b, got, KernelOptions(), {"impl": dispatch.NARROW})
    assert rel_err(got, want) < 1e-5
    with pytest.raises(ConfigError, match="W8A8 GEMM only"):
        dispatch.linear(want, want, None, got, KernelOptions(), {"impl": dispatch.NARROW})
    assert dispatch.fp8_default_gemm(KernelOptions(), x8, w8) == "cublas"  # no GPU, no shape


def test_narrow_gemm_runs_by_default_only_where_it_was_measured_faster():
    """NARROW_LAUNCHES: Llama-3-70B's [N, K] weights at 129-192 rows, each row bound its own
    launch; nothing at 128 rows or fewer, above the last bound, or at another shape."""
    from nanosched.kernels import dispatch

    d = (8192, 28672)
    assert dispatch.narrow_launch(128, *d) is None and dispatch.narrow_launch(193, *d) is None
    assert dispatch.narrow_launch(129, *d) == dispatch.narrow_launch(160, *d)
    assert dispatch.narrow_launch(161, *d) == dispatch.narrow_launch(192, *d) is not None
    assert dispatch.narrow_launch(160, 4096, 4096) is None
    cfg = dispatch.narrow_config(170, *d)
    assert (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.split_k) == \
        dispatch.narrow_launch(170, *d)
    assert dispatch.narrow_config(100, 4096, 4096).split_k == 1  # a named launch elsewhere
