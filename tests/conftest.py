"""Test-wide setup: Triton's CPU interpreter on machines without a GPU.

TRITON_INTERPRET must be set before triton is first imported; nanosched imports triton lazily
and this file runs before any test module, so setting it here covers every test. On a GPU
machine it stays unset and the Triton kernels compile for the GPU (tests/gpu/).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
