"""Green-context partitions and the profiler's GPU backend (timing the model's kernels through
nanosched.kernels.dispatch), on a real GPU (`pytest -m gpu`)."""

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("small", [32, 40, 48])
def test_split_gives_disjoint_sm_sets(small):
    from smid import partition_sm_ids

    from nanosched.greenctx import split_sms

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    pair = split_sms(0, small)
    try:
        assert pair.small.sms >= small and pair.small.sms + pair.rest.sms <= num_sms
        ids_small = partition_sm_ids(pair.small, 4096)
        ids_rest = partition_sm_ids(pair.rest, 4096)
        assert not ids_small & ids_rest
        assert pair.small.sms // 2 <= len(ids_small) <= pair.small.sms
        assert pair.rest.sms // 2 <= len(ids_rest) <= pair.rest.sms
    finally:
        pair.close()


def test_gemm_on_a_partition_stream_is_right():
    from nanosched.greenctx import split_sms

    pair = split_sms(0, 32)
    try:
        a = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16)
        ref = (a.float() @ b.float())
        for part in (pair.small, pair.rest):
            with torch.cuda.stream(part.stream):
                out = a @ b
            part.stream.synchronize()
            assert torch.allclose(out.float(), ref, rtol=2e-2, atol=0.5)
    finally:
        pair.close()


def test_gpu_backend_times_a_row_and_a_pair():
    from nanosched.models.spec import load_spec
    from nanosched.profiler.gpu_backend import GPUBackend
    from nanosched.profiler.plan import KernelTask, PairTask, ProfileSettings
    from nanosched.workloads import fixed

    backend = GPUBackend(0, rep_ms=5)
    try:
        s = ProfileSettings(load_spec("llama3-8b"), 1, fixed(1024, 512), 512, quick=True)
        small, rest = backend.make_partitions((32,))[0]
        n = backend.num_sms
        timed = backend.time_kernel(s, KernelTask("ug", 512, 0, n, "full", "cublas"))
        assert timed.clock_mhz is not None and 0 < timed.power_w < 2000  # NVML sampled
        full = timed.us
        part = backend.time_kernel(s, KernelTask("ug", 512, 0, rest, "green_ctx",
                                                 "triton_persistent_128x128")).us
        attn = backend.time_kernel(s, KernelTask("attn_decode", 512, 1024, n, "full",
                                                 "triton_pipelined")).us
        bound = backend.time_kernel(s, KernelTask("attn_decode", 512, 1024, 16, "cta_bound",
                                                  "triton_pipelined")).us
        norm = backend.time_kernel(s, KernelTask("add_norm_ffn", 512, 0, n, "full",
                                                 "triton")).us
        assert attn < bound and 0 < norm < attn
        assert 0 < full < part < 10 * full
        alone = backend.time_sustained(s, KernelTask("ug", 512, 0, n, "full", "cublas"), full)
        assert alone.us > 0.9 * full and alone.clock_mhz is not None
        task = PairTask("ug", 512, "attn_decode", "memory", 1024, "green_ctx", "cublas", rest,
                        small, "triton_pipelined")
        pair = backend.time_pair(s, task, (full, attn))
        assert pair.compute_us > 0.9 * full and pair.other_us > 0.9 * attn
        assert pair.clock_mhz is not None and pair.power_w > 0
    finally:
        backend.close()


def test_gpu_backend_times_a_layer_sustained_each_op_near_its_row():
    """`time_layer`: a Sequential layer of the model's kernels (each in its own CUDA graph),
    looped until the clock settled: every op's time in it near its row, the clock sampled."""
    from dataclasses import replace

    from nanosched.models.spec import load_spec
    from nanosched.profiler.gpu_backend import GPUBackend
    from nanosched.profiler.plan import ProfileSettings, layer_tasks
    from nanosched.workloads import fixed

    backend = GPUBackend(0, rep_ms=5)
    try:
        s = replace(ProfileSettings(load_spec("llama3-8b"), 1, fixed(1024, 512), 512,
                                    quick=True), pair_settle_ms=200.0, pair_window_ms=500.0)
        impl = {"kqv": "cublas", "o": "cublas", "ug": "cublas", "d": "cublas",
                "attn_decode": "triton_pipelined"}
        task = layer_tasks(s, backend.num_sms, s.decode_contexts(),
                           lambda op, t, c: impl.get(op, "triton"))[-1]
        assert task.tokens == 512 and task.num_decode == 128
        layer = backend.time_layer(s, task)
        rows = [backend.time_kernel(s, k).us for k in task.ops]
        assert layer.clock_mhz is not None and layer.power_w > 0
        for k, us, row in zip(task.ops, layer.op_us, rows, strict=True):
            assert 0.5 * row < us < 2.0 * row, (k.op, us, row)
    finally:
        backend.close()
