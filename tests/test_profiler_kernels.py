"""The profiler's Triton kernels against torch, under TRITON_INTERPRET=1 on the CPU (fp32)."""

import os
import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import torch
    from nanosched.profiler.triton_kernels import decode_attention, persistent_linear
    torch.manual_seed(0)
    x, w = torch.randn(100, 96), torch.randn(70, 96)
    out = torch.empty(100, 70)
    for sms in (1, 3, 50):  # fewer programs than tiles, and more
        persistent_linear(x, w, out, num_sms=sms, block_m=32, block_n=32, block_k=32,
                          num_warps=1)
        assert torch.allclose(out, x @ w.T, atol=1e-3), (sms, (out - x @ w.T).abs().max())
    T, Hq, Hkv, C, d = 3, 8, 2, 70, 16
    q, k, v = torch.randn(T, Hq, d), torch.randn(T, Hkv, C, d), torch.randn(T, Hkv, C, d)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2)
    for ctas in (1, 2, 64):
        o = decode_attention(q, k, v, torch.empty_like(q), num_ctas=ctas, block_n=32)
        assert torch.allclose(o, ref, atol=1e-4), (ctas, (o - ref).abs().max())
    print("ok")
""")


def test_persistent_gemm_and_bounded_decode_attention_match_torch():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
