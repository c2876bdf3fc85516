"""Issue rate of the instructions an FP8 decode-attention consumer spends per element.

    PYTHONPATH=. python bench/kernels/fp8_convert_rate.py

What bounds `cuda_bulk`'s FP8 consumers on few SMs is either the rate of one kind of
instruction or the latency of their chains. This times long chains of one instruction each
(eight independent chains a thread, 32 warps an SM, every SM) with the SM's own clock
(`clock64`), so each row reads warp-instructions per cycle per SM:

- `cvt_e4m3`: `cvt.rn.f16x2.e4m3x2`, two e4m3 to an f16x2 (the kernel's conversion);
- `bits_e4m3`: the same conversion by bit moves (shift, mask, merge: the value x 2^-8);
- `lop3`, `prmt`, `hfma2`, `ffma`: a logic op, a byte permute, a packed f16 FMA and an fp32 FMA,
  the pipes those belong to, for scale.

JSON to $OUT or bench/results/; a table last.
"""

from __future__ import annotations

import torch

from bench._common import environment, print_table, write_result

ITERS = 4096
CHAINS = 8
THREADS = 1024

SOURCE = r"""
typedef unsigned int u32;
__device__ __forceinline__ u32 op(u32 x) {
#if OP == 0
  u32 r;
  asm volatile("{.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;}"
               : "=r"(r) : "r"(x));
  return r;
#elif OP == 1
  return (x & 0x80008000u) | ((x >> 1) & 0x3f803f80u);
#elif OP == 2
  u32 r;
  asm volatile("lop3.b32 %0, %1, %2, %3, 0x96;" : "=r"(r) : "r"(x), "r"(0x5a5a5a5au),
               "r"(0x33cc33ccu));
  return r;
#elif OP == 3
  return __byte_perm(x, 0x01234567u, 0x3120);
#elif OP == 4
  u32 r;
  asm volatile("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(0x3c003c00u),
               "r"(0x00010001u));
  return r;
#else
  float f = __uint_as_float(x);
  f = fmaf(f, 0.999f, 1e-3f);
  return __float_as_uint(f);
#endif
}

extern "C" __global__ void chains(u32* out, long long* cycles, int iters) {
  u32 x[CHAINS];
#pragma unroll
  for (int i = 0; i < CHAINS; ++i) x[i] = threadIdx.x * 0x01010101u + i;
  __syncthreads();
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < CHAINS; ++i) x[i] = op(x[i]);
  }
  __syncthreads();
  long long t1 = clock64();
  u32 acc = 0;
#pragma unroll
  for (int i = 0; i < CHAINS; ++i) acc ^= x[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}
"""

OPS = {"cvt_e4m3": 0, "bits_e4m3": 1, "lop3": 2, "prmt": 3, "hfma2": 4, "ffma": 5}


def rate(name: str, code: int, sms: int) -> dict:
    import cupy

    module = cupy.RawModule(code=SOURCE, options=("-std=c++17", f"-DOP={code}",
                                                 f"-DCHAINS={CHAINS}"))
    kernel = module.get_function("chains")
    out = cupy.zeros(sms * THREADS, dtype=cupy.uint32)
    cycles = cupy.zeros(sms, dtype=cupy.int64)
    for _ in range(2):  # the second launch is timed: the first loads the module
        kernel((sms,), (THREADS,), (out, cycles, cupy.int32(ITERS)))
    cupy.cuda.runtime.deviceSynchronize()
    cyc = float(cycles.get().mean())
    warp_instr = THREADS // 32 * ITERS * CHAINS
    return {"op": name, "cycles": cyc, "warp_instr_per_clk_sm": warp_instr / cyc,
            "lanes_per_clk_sm": 32 * warp_instr / cyc}


def main() -> None:
    env = environment()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [rate(name, code, sms) for name, code in OPS.items()]
    path = write_result("fp8_convert_rate", {"env": env, "iters": ITERS, "chains": CHAINS,
                                             "threads": THREADS, "rows": rows})
    print(f"{env['device']}: {path}")
    print_table(rows, [("op", "op", ""), ("warp_instr_per_clk_sm", "warp instr / clk / SM", ".2f"),
                       ("lanes_per_clk_sm", "lanes / clk / SM", ".0f")])


if __name__ == "__main__":
    main()
