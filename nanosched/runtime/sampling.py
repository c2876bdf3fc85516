"""Token sampling: greedy, temperature and top-p (nucleus), batched over the sampled rows."""

from __future__ import annotations

from typing import Any

import torch

# Rows drawn at once: a random draw holds up to TRANSIENT_BYTES_PER_LOGIT of temporaries per
# logit (fp32 copies, the sort's values and int64 order, the cut, the noise; 42.1 measured on an
# H200: 1.38 GB for 256 rows of Llama-3's 128k vocabulary); a batch's sampled rows go through in
# chunks this tall so the engine's memory reserve (runtime/loader.py) need not grow with it.
CHUNK_ROWS = 256
TRANSIENT_BYTES_PER_LOGIT = 48


def transient_bytes(rows: int, vocab: int) -> int:
    """The most memory `sample` takes beside its input for `rows` rows of `vocab` logits."""
    return min(rows, CHUNK_ROWS) * vocab * TRANSIENT_BYTES_PER_LOGIT


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           generator: torch.Generator | None = None, *,
           any_random: bool | None = None) -> torch.Tensor:
    """Next token per row, or -1 for a row that cannot be sampled.

    logits [N, V] (any float dtype), temperature [N] (0 = greedy), top_p [N] in (0, 1].
    Returns [N] int64 on the logits' device. Rows with temperature 0 take the argmax. A row
    whose logits hold NaN or +inf gives -1 (its request has failed; the caller ends it) and is
    sampled as if uniform, so one bad row neither fails the batch's draw nor changes the draws
    of the others. Given `any_random` (whether some row has a temperature above 0, which the
    caller knows on the host), nothing here waits for the device: the draw is an exponential
    race on the device's generator. None reads it from `temperature`, which on a GPU waits for
    everything queued before it (the forward that made `logits`).
    """
    if logits.shape[0] <= CHUNK_ROWS:
        return _sample_rows(logits, temperature, top_p, generator, any_random)
    if any_random is None:
        any_random = bool((temperature > 0).any())
    return torch.cat([_sample_rows(logits[i:i + CHUNK_ROWS], temperature[i:i + CHUNK_ROWS],
                                   top_p[i:i + CHUNK_ROWS], generator, any_random)
                      for i in range(0, logits.shape[0], CHUNK_ROWS)])


def _sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 generator: torch.Generator | None, any_random: bool | None) -> torch.Tensor:
    bad = torch.isnan(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1)
    logits = logits.masked_fill(bad.unsqueeze(1), 0.0)
    greedy = logits.argmax(dim=-1)
    is_random = temperature > 0
    if any_random is None:
        any_random = bool(is_random.any())
    if not any_random:
        return torch.where(bad, -1, greedy)
    scaled = logits.float() / temperature.clamp_min(1e-6).unsqueeze(1)  # [N, V]
    probs = torch.softmax(scaled, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # keep the smallest prefix whose mass reaches top_p (always at least the top token)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    sorted_p = sorted_p.masked_fill(before >= top_p.unsqueeze(1), 0.0)
    # an exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) draws i with probability p_i
    # (as torch.multinomial does, which on a GPU may wait for it)
    noise = torch.empty_like(sorted_p).exponential_(generator=generator)
    pick = (sorted_p / noise).argmax(dim=-1)  # [N]
    drawn = order.gather(1, pick.unsqueeze(1)).squeeze(1)
    return torch.where(bad, -1, torch.where(is_random, drawn, greedy))


def to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """`tokens` on their way to the host: on a GPU a pinned copy queued after them and an
    event that says when it has landed (read it after `event.synchronize()`); on the CPU the
    tokens themselves and None."""
    if tokens.device.type != "cuda":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
