"""Kernels with a bounded SM footprint (Triton), each beside a plain torch reference.

`dispatch` is the models' entry point and picks the implementation (`KernelOptions`);
`reference` holds the torch references; `decode_attn`, `elementwise` and `gemm` hold the Triton
kernels and import triton, so they are imported lazily (never from this package's __init__).
"""

from nanosched.kernels.dispatch import KernelOptions, triton_available, use_triton

__all__ = ["KernelOptions", "triton_available", "use_triton"]
