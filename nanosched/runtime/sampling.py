"""Token sampling: greedy, temperature and top-p (nucleus), batched over the sampled rows."""

from __future__ import annotations

from typing import Any

import torch


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
