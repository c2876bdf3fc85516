"""Small helpers shared by the Triton kernels: SM counts and dot precision.

No triton import here, so the dispatcher can use these on machines without triton.
"""

from __future__ import annotations

import functools
import os

import torch

INTERPRET_NUM_SMS = 4  # stand-in SM count under TRITON_INTERPRET=1 (CPU tensors)
CTAS_PER_SM = 4  # default grid of a persistent memory-bound kernel, per SM


def is_interpret() -> bool:
    """Whether Triton runs in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (INTERPRET_NUM_SMS for a CPU device)."""
    if device.type != "cuda":
        return INTERPRET_NUM_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def default_num_ctas(device: torch.device) -> int:
    """Default bound on a persistent kernel's programs: CTAS_PER_SM per SM."""
    return CTAS_PER_SM * num_sms(device)


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact fp32 for fp32 inputs (no TF32), the default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (the models ask here instead of touching torch.cuda)."""
    return torch.cuda.is_available()


def bind_device(device: torch.device) -> None:
    """Make `device` the current CUDA device of this thread (Triton launches there).

    A bare "cuda" (no index) means the current device; torch.cuda.set_device refuses it.
    """
    if device.type == "cuda":
        torch.cuda.set_device(torch.cuda.current_device() if device.index is None
                              else device.index)
