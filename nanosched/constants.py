"""Numbers more than one part of nanosched must agree on. Pure Python: every package may import
this module (tests/test_layering.py allows it everywhere)."""

TOKEN_QUANTUM = 128  # dense batches and nano-batch ranges are multiples of this many tokens
PAGE_SIZE = 16  # tokens per page of the paged KV cache (the engine's and the profiler's default)
KV_DTYPES = ("auto", "fp8")  # KV cache element types: the model's dtype, or e4m3 with scales
# layer weights a profile is measured on and a schedule runs on (models/quant.py: none | fp8)
QUANTIZATIONS = ("none", "fp8")
DEFAULT_NUM_SMS = 132  # SMs of an H100 / H200 SXM: the default where no GPU is at hand
# the baseline strategy's name (runtime/strategies/sequential.py: one op after another, one
# stream), and the kind of a schedule-set entry that runs it (schedules/sets.py)
SEQUENTIAL = "sequential"
MAX_SMS = 4096  # the most SMs a profile or a schedule may name (a bound on hostile files)
DEFAULT_GPU = "h100"  # the GPU prior assumed with no --gpu and no GPU present (hardware.py)
# how a kernel shares the GPU, as profiles and schedules record it (autosearch/durations.py
# `Mechanism`): the whole GPU, a green-context partition, a CTA-bounded grid, a stream priority
MECHANISMS = ("full", "green_ctx", "cta_bound", "stream_priority")
# NVLink multicast stays off on shared multi-GPU hosts: NCCL's NVLS, PyTorch symmetric memory's
# and NVSHMEM's. Set in the environment before NCCL initialises (spawned ranks inherit it).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
# Processes the tool spawns (`python -c ...`: tp ranks, the network profiler's workers, the
# resource tracker) put the current folder first on sys.path while they boot, so a `struct.py`
# there would be imported by each. PYTHONSAFEPATH (Python >= 3.11) leaves it off; set in the
# environment they inherit before the first spawn.
SAFE_PATH = {"PYTHONSAFEPATH": "1"}
