r"""The shortest period of a fixed pipeline structure, without a solver; pure Python.

Given nano-ops x with integer durations d_x, layer offsets k_x ∈ {0, 1}, a stream and an
issue order per stream (by phase φ_x = s_x − k_x τ), and dependencies (x → y, δ), find the
least integer τ with starts s_x such that

    s_y + δ τ ≥ s_x + d_x                   every dependency
    φ_{i+1} ≥ φ_i + d_i                      consecutive nano-ops i, i + 1 of a stream
    φ_first + τ ≥ φ_last + d_last            the stream's next period starts after this one
    0 ≤ φ_x ≤ τ − 1,  s_x + d_x ≤ 2 τ        phases lie in one period; a layer spans ≤ 2 periods

More in docs/search.md, module notes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class Precedence(NamedTuple):
    """Dependency (x → y, δ): y in layer l + δ starts after x in layer l ends."""

    src: str
    dst: str
    shift: int


def _longest_starts(nodes: list[str], arcs: list[tuple[str, str, int]]) -> dict[str, int] | None:
    """Least starts satisfying s_v >= s_u + w for all arcs (u, v, w), or None (positive cycle)."""
    dist = dict.fromkeys(nodes, 0)
    for _ in range(len(nodes) + 1):
        changed = False
        for u, v, w in arcs:
            if dist[u] + w > dist[v]:
                dist[v] = dist[u] + w
                changed = True
        if not changed:
            return dist
    return None


def feasible_starts(durations: dict[str, int], orders: dict[str, list[str]],
                    deps: Iterable[Precedence], tau: int,
                    offsets: dict[str, int] | None = None) -> dict[str, int] | None:
    """Starts meeting every constraint above at period `tau`, or None.

    `deps` holds (x, y, δ): y (in layer l + δ) needs x (in layer l). Offsets default to 0.
    """
    k = offsets or {}
    origin, nodes = "<origin>", [*durations, "<origin>"]
    arcs = [(origin, x, k.get(x, 0) * tau) for x in durations]
    arcs += [(x, origin, max(durations[x] - 2 * tau, 1 - (k.get(x, 0) + 1) * tau))
             for x in durations]
    arcs += [(x, y, durations[x] - shift * tau) for x, y, shift in deps]
    for chain in orders.values():
        arcs += [(a, b, durations[a] + (k.get(b, 0) - k.get(a, 0)) * tau)
                 for a, b in zip(chain, chain[1:], strict=False)]
        if chain:
            a, b = chain[-1], chain[0]
            arcs.append((a, b, durations[a] + (k.get(b, 0) - k.get(a, 0) - 1) * tau))
    dist = _longest_starts(nodes, arcs)
    if dist is None or dist[origin] > 0:
        return None
    return {x: dist[x] for x in durations}


def min_period(durations: dict[str, int], orders: dict[str, list[str]],
               deps: list[Precedence], offsets: dict[str, int] | None = None
               ) -> tuple[int, dict[str, int]] | None:
    """(least τ, starts) for the fixed structure, or None if no τ works."""
    lo = max([sum(durations[x] for x in chain) for chain in orders.values()] + [1])
    hi = max(lo, 2 * sum(durations.values()) + 1)
    best = feasible_starts(durations, orders, deps, hi, offsets)
    if best is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        starts = feasible_starts(durations, orders, deps, mid, offsets)
        if starts is None:
            lo = mid + 1
        else:
            hi, best = mid, starts
    return hi, best
