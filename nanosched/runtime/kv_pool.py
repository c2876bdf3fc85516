"""`KVPool`: the KV pages the "use" and "predict" policies give, take and move; admission settings.

`AdmissionConfig` is what the flags ask for (`--admission`, `--kv-headroom`, `--preemption`,
`--swap-space`), range-checked with errors that name the flag. `KVPool` is the mechanism under
the policy of runtime/request_scheduler.py: it reserves a request's prefill pages at admission,
the page a decode needs, and preempts a request by recompute (free its pages; it prefills its
prompt and its outputs again) or by swap (its pages to host memory, runtime/offload.py),
counting each in `PreemptStats`. Which of the two: `--preemption recompute` or `swap` as asked
(swap falls back to recompute when host memory is full), `auto` by the cost rule
`offload.prefer_swap`.

More in docs/admission.md, module notes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from nanosched.errors import ConfigError
from nanosched.models.kvcache import KVCache
from nanosched.runtime.offload import HostSwap, SwapCost, prefer_swap, swap_cost
from nanosched.runtime.requests import Request

POLICIES = ("reserve", "use", "predict")
PREEMPTION_MODES = ("recompute", "swap", "auto")
# the host link the cost rule assumes when not told: a PCIe Gen4 x16 link's usable bandwidth
DEFAULT_LINK_GB_S = 25.0


@dataclass(frozen=True)
class AdmissionConfig:
    """How the request scheduler admits requests and what it does when KV pages run out."""

    # "reserve": peak if every request generates max_tokens; "use": pages needed now; "predict":
    # peak with outputs predicted from ended requests; the last two preempt when pages run out
    policy: str = "use"
    headroom: float = 0.0  # "use", "predict": share of the cache left free past an admission
    preemption: str = "recompute"  # "recompute" | "swap" | "auto" (the cost rule)
    swap_space_gib: float = 4.0  # host memory for swapped-out KV
    link_gb_s: float = DEFAULT_LINK_GB_S  # host link bandwidth for the cost rule
    gemm_tflops: float | None = None  # None: offload.DEFAULT_GPU_TFLOPS (GPU) or CPU_TFLOPS

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"--admission must be one of {', '.join(POLICIES)}; got "
                              f"{self.policy!r}")
        if not 0 <= self.headroom < 1:
            raise ConfigError(f"--kv-headroom must be in [0, 1) (a share of the KV cache), got "
                              f"{self.headroom}")
        if self.preemption not in PREEMPTION_MODES:
            raise ConfigError(f"--preemption must be one of {', '.join(PREEMPTION_MODES)}; "
                              f"got {self.preemption!r}")
        if not 0 <= self.swap_space_gib <= 1 << 20:
            raise ConfigError(f"--swap-space must be in [0, {1 << 20}] GiB, got "
                              f"{self.swap_space_gib}")
        if not self.link_gb_s > 0 or (self.gemm_tflops is not None and not self.gemm_tflops > 0):
            raise ConfigError(f"the swap cost rule needs a positive link bandwidth and GEMM "
                              f"rate, got {self.link_gb_s} GB/s and {self.gemm_tflops} TFLOP/s")


@dataclass
class PreemptStats:
    recomputed: int = 0  # preemptions by recompute
    swapped: int = 0  # preemptions by swap-out
    swap_ins: int = 0
    recomputed_tokens: int = 0  # KV tokens dropped by recompute preemptions (prefilled again)
    swapped_tokens: int = 0  # KV tokens copied out

    @property
    def preemptions(self) -> int:
        return self.recomputed + self.swapped

    def as_dict(self) -> dict[str, int]:
        return asdict(self) | {"preemptions": self.preemptions}


class KVPool:
    """Pages under "use" and "predict": reserve, preempt (recompute or swap), resume.

    With a `journal` (tp > 1) every change to the cache's pages or the host copies is also
    appended to it as an op of `replay_kv_ops`, for the other ranks to make on their shards."""

    def __init__(self, kv: KVCache, cfg: AdmissionConfig, cost: SwapCost,
                 journal: list[tuple] | None = None) -> None:
        self.kv, self.cfg, self.cost = kv, cfg, cost
        self.journal = journal
        self.page_size = kv.page_size
        self.headroom_pages = math.ceil(cfg.headroom * kv.allocator.num_pages)
        self.swap = HostSwap(kv, int(cfg.swap_space_gib * 2**30)) \
            if cfg.preemption != "recompute" else None
        self.stats = PreemptStats()

    @property
    def num_free(self) -> int:
        return self.kv.allocator.num_free

    def held(self, r: Request) -> int:
        return self.kv.num_held(r.request_id)

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # ---- running requests ------------------------------------------------------------------
    def decode_need(self, r: Request) -> int:
        """Pages `r`'s decode this step still needs (0 when it does not decode)."""
        if r.is_prefilling or r.finished or r.num_output >= r.params.max_tokens:
            return 0
        return max(0, self._pages(r.prompt_len + r.num_output) - self.held(r))

    def reserve_decode(self, r: Request) -> None:
        """Allocate the page `r`'s decode writes into (its position: prompt + outputs - 1), if
        it decodes this step and lacks it."""
        if self.decode_need(r) > 0:
            self.kv.reserve(r.request_id, r.prompt_len + r.num_output)
            self._log("reserve", r.request_id, r.prompt_len + r.num_output)

    def release(self, r: Request) -> None:
        """Free `r`'s pages (its every token is sampled; nothing will read them again)."""
        self.kv.release(r.request_id)
        self._log("release", r.request_id)

    def preempt(self, r: Request) -> str:
        """Take `r`'s pages: "swap" (to host memory) or "recompute" (dropped; `r` prefills its
        prompt and outputs again). Returns the mode used."""
        tokens = self.kv.length(r.request_id)
        if self._should_swap(tokens):
            self.swap.swap_out(r.request_id)
            self._log("swap_out", r.request_id)
            self.stats.swapped += 1
            self.stats.swapped_tokens += tokens
            return "swap"
        self.kv.release(r.request_id)
        self._log("release", r.request_id)
        r.num_prefilled, r.num_recompute = 0, r.num_output
        self.stats.recomputed += 1
        self.stats.recomputed_tokens += tokens
        return "recompute"

    def _should_swap(self, tokens: int) -> bool:
        if self.swap is None or tokens == 0 or not self.swap.fits(tokens):
            return False
        return self.cfg.preemption == "swap" or prefer_swap(tokens, self.cost)

    # ---- waiting requests ------------------------------------------------------------------
    def admit_need(self, r: Request) -> int:
        """Pages `r` takes when admitted: its whole prefill, or what it held when swapped."""
        tokens = r.prefill_len
        if self.swap is not None and self.swap.holds(r.request_id):
            tokens = max(tokens, self.swap.length(r.request_id))
        return self._pages(tokens)

    def can_admit(self, r: Request, alone: bool, shared: int = 0) -> bool:
        """Whether `r`'s pages are free with the headroom left over (no headroom when nothing
        else runs), and every token it sampled is on the host; `shared` of its pages are
        cached pages other requests hold (a prefix-cache hit: they cost nothing)."""
        headroom = 0 if alone else self.headroom_pages
        return r.pending == 0 and self.admit_need(r) - shared + headroom <= self.num_free

    def swapped(self, r: Request) -> bool:
        """Whether `r`'s KV is on the host (it is swapped back in when admitted)."""
        return self.swap is not None and self.swap.holds(r.request_id)

    def admit(self, r: Request) -> bool:
        """Give `r` its pages; True when it was swapped in (it runs from the next step)."""
        if self.swap is not None and self.swap.holds(r.request_id):
            self.swap.swap_in(r.request_id, r.prefill_len)
            self._log("swap_in", r.request_id, r.prefill_len)
            self.stats.swap_ins += 1
            return True
        self.kv.reserve(r.request_id, r.prefill_len)
        self._log("reserve", r.request_id, r.prefill_len)
        return False

    def begin_step(self) -> None:
        if self.swap is not None:
            self.swap.begin_step()
            self._log("begin_step")

    def drop(self, r: Request) -> None:
        """Forget any host copy of `r` (it ended or was aborted)."""
        if self.swap is not None and self.swap.holds(r.request_id):
            self.swap.drop(r.request_id)
            self._log("drop", r.request_id)

    def _log(self, op: str, *args: int) -> None:
        if self.journal is not None:
            self.journal.append((op, *args))


def make_pool(model: Any, kv: KVCache, cfg: AdmissionConfig,
              journal: list[tuple] | None = None) -> KVPool | None:
    """The pool of the "use" and "predict" policies for `model`'s cache (None: "reserve")."""
    if cfg.policy == "reserve":
        return None
    return KVPool(kv, cfg, swap_cost(model, kv, cfg.link_gb_s, cfg.gemm_tflops), journal)


def replay_kv_ops(ops: list[tuple], kv: KVCache, swap: HostSwap | None) -> None:
    """Make the changes a rank 0 `KVPool` (and engine) journaled on this rank's cache and host
    copies, in order: the same calls on the same bookkeeping give the same pages, so block
    tables need not travel (each rank moves the data of its own KV heads). Prefix caching
    journals its decisions ("share" a request's cached pages, "register" a page's hash): the
    other ranks index the same pages without hashing a token."""
    for op, *args in ops:
        if op == "reserve":
            kv.reserve(*args)
        elif op == "release":
            kv.release(*args)
        elif op == "share":
            kv.share(args[0], list(args[1]), args[2])
        elif op == "register":
            kv.register(*args)
        elif swap is None:
            raise ConfigError(f"KV op {op!r} needs host swap space, which this rank has none of")
        else:
            getattr(swap, op)(*args)  # swap_out, swap_in, begin_step, drop
