"""Numbers every stage must agree on, in one place (pure: imports nothing).

- `TOKEN_QUANTUM`: dense batches, nano-batch boundaries and the profiler's token grid are
  multiples of 128 tokens, so the search only asks the profile for token counts it measured.
- `PAGE_SIZE`: tokens per KV-cache page, the default of the cache, the engine and the profiled
  paged-attention kernels.
- `DEFAULT_NUM_SMS`: the SM count assumed where no GPU can be asked (an H100's or H200's 132).
"""

TOKEN_QUANTUM = 128
PAGE_SIZE = 16
DEFAULT_NUM_SMS = 132
