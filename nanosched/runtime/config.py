"""`EngineConfig`: how one engine is assembled and run, the same record for every command.

`nanosched bench`, `serve` and `generate` and the timeline harness turn their flags into an
`EngineConfig`; `loader.load_engine` resolves what it leaves open (`None`, `"auto"`) against the
model, the schedule and the GPU, and `Engine` reads the resolved values. The objects an engine
runs with (the model, the strategy, the stream device, callbacks) are not part of it: they are
passed beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanosched.constants import PAGE_SIZE, SEQUENTIAL
from nanosched.errors import ConfigError
from nanosched.kernels.dispatch import KernelOptions
from nanosched.models.kvcache import check_kv_dtype
from nanosched.models.quant import check_quantization
from nanosched.runtime.kv_pool import AdmissionConfig

GRAPH_MODES = ("off", "on", "layout")  # what an Engine runs; the loader also takes "auto"

DTYPES = ("auto", "bfloat16", "float16")  # --dtype, as vLLM names them


@dataclass(frozen=True)
class EngineConfig:
    """What to load, and how the engine runs.

    Loading: `model` is a registered name, an HF folder or a config.json (None when the caller
    brings the model object); `weights` is "random" (seeded) or a checkpoint folder, None for
    the `model` folder's safetensors when it has some, else random; `schedule` is sequential,
    two_batch, auto (a matching shipped schedule, else sequential) or a schedule JSON file,
    refused for another model, tp or GPU unless `force`; `mem_util` is the share of the GPU's
    memory that weights and KV cache may fill.

    Running (None and "auto" are resolved by the loader): `dense_batch` tokens per iteration
    (the schedule's, else 2048 on a GPU, 256 on the CPU); `num_pages` KV-cache pages (what
    fits); `kv_dtype` the cache's element type ("auto": the model's; "fp8": e4m3 with scales);
    `quantization` the layer weights' ("auto": the checkpoint's; "fp8": e4m3 weights and
    activations, quantised as a plain checkpoint loads); `max_context` the longest request
    (the longest known request, else the model's positions; `--max-model-len`); `dtype` the
    weights' (auto: `loader.model_dtype`; `--dtype`);
    `graphs` off, on (a CUDA graph per batch bucket), layout (bucket layout, run eagerly) or auto
    (on with a GPU); `eos_ids` (the checkpoint's); `async_loop` (on with a
    GPU); `time_forwards` times every forward (it synchronises); `gpu_timeline` records a CUDA
    event before and after each iteration's GPU work, never waiting on them
    (`Engine.gpu_timeline_report()` then says how long the GPU waited for the CPU between
    iterations);
    `admission` how the request scheduler admits requests and preempts them when KV pages run out
    (runtime/kv_pool.py); `prefix_caching` keeps full KV pages indexed by content and
    shares them between requests with the same prefix (runtime/request_scheduler.py).
    """

    model: str | None = None
    weights: str | None = None
    tp: int = 1
    device: str = "auto"  # auto | cpu | cuda
    schedule: str = SEQUENTIAL
    force: bool = False
    mem_util: float = 0.85
    kernels: KernelOptions = field(default_factory=KernelOptions)
    dense_batch: int | None = None
    num_pages: int | None = None
    page_size: int = PAGE_SIZE
    kv_dtype: str = "auto"  # auto (the model's dtype) | fp8 (e4m3 + scales; models/kvcache.py)
    quantization: str = "auto"  # auto (the checkpoint's) | none | fp8 (W8A8; models/quant.py)
    max_context: int | None = None
    dtype: str = "auto"  # auto (bf16 on a GPU, fp32 on the CPU) | bfloat16 | float16
    graphs: str = "off"
    graph_align: int = 32  # decode rows of a graph bucket are a multiple of this
    seed: int = 0  # random weights and sampling
    eos_ids: frozenset[int] | None = None
    async_loop: bool | None = None
    time_forwards: bool = False
    gpu_timeline: bool = False
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    prefix_caching: bool = True  # share full KV pages of equal prefixes (--enable-prefix-caching)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError(f"--tp must be at least 1, got {self.tp}")
        for name in ("page_size", "graph_align"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("dense_batch", "num_pages"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
        check_kv_dtype(self.kv_dtype)
        check_quantization(self.quantization, allow_auto=True)
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_context is not None and self.max_context < 1:
            raise ConfigError(f"--max-model-len must be at least 1, got {self.max_context}")
        if not 0 < self.mem_util <= 1:
            raise ConfigError(f"mem_util must be in (0, 1], got {self.mem_util}")
