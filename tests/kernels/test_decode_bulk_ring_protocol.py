"""The `cuda_bulk` ring's mbarrier protocol, modelled: one producer fills slots in ring order,
consumer warps wait on a slot's `full` barrier by the parity of its use and arrive on its
`empty` one. A wait names only the parity of a use, so the kernel is correct only if no
consumer can find a slot two uses past the one it waits for. The model runs the protocol under
random interleavings (landings out of order, warps at any relative speed) and checks that
invariant and that every run finishes; it also shows why two warps per head taking alternate
pages of one ring (each skipping the other's uses) were not kept (decode_attn_bulk.cu's header).
"""

import random

import pytest

PAGE_SLOTS = 2  # a page's K slot and V slot (FP8, and bf16's default 32 KB slots)


def run(slots: int, heads: int, halves: int, items: list[int], seed: int) -> tuple[str, bool]:
    """('ok' | 'deadlock', whether a warp ever waited on a slot two uses past its own) for
    `heads` consumer warps per half, each half taking every `halves`-th page of an item."""
    rnd = random.Random(seed)
    full_done = [0] * slots  # completed phases of each slot's `full` barrier
    empty_done = [0] * slots
    empty_arrivals = [0] * slots
    landing: list[int] = []  # slots whose copies are in flight
    owner = [i % halves for n in items for i in range(n)]  # the half reading each page
    positions = len(owner) * PAGE_SLOTS
    produced = 0
    warps = [{"half": h, "pos": 0} for h in range(halves) for _ in range(heads)]
    stale = False
    while True:
        moves = []
        if produced < positions:
            s, use = produced % slots, produced // slots
            if empty_done[s] % 2 != (use & 1) ^ 1:  # the producer's wait on `empty`
                moves.append(("issue", None))
        if landing:
            moves.append(("land", None))
        for w in warps:
            if w["pos"] >= positions:
                continue
            s, use = w["pos"] % slots, w["pos"] // slots
            stale |= full_done[s] >= use + 2
            if full_done[s] % 2 != use & 1:  # the consumer's wait on `full`
                moves.append(("read", w))
        if not moves:
            done = produced == positions and not landing and all(
                w["pos"] == positions for w in warps)
            return ("ok" if done else "deadlock"), stale
        kind, w = rnd.choice(moves)
        if kind == "issue":
            landing.append(produced % slots)
            produced += 1
        elif kind == "land":
            full_done[landing.pop(rnd.randrange(len(landing)))] += 1
        else:
            s = w["pos"] % slots
            if owner[w["pos"] // PAGE_SLOTS] == w["half"]:  # its page: read, then give back
                empty_arrivals[s] += 1
                if empty_arrivals[s] == heads:
                    empty_arrivals[s] = 0
                    empty_done[s] += 1
            w["pos"] += 1


def cases(n: int):
    rnd = random.Random(1)
    for seed in range(n):
        items = [rnd.choice([0, 1, 2, 3, 4, 7, 16]) for _ in range(rnd.randint(1, 10))]
        yield rnd.choice([4, 5, 6, 7, 11]), rnd.choice([1, 2, 8]), items, seed


@pytest.mark.parametrize("block", range(4))
def test_every_warp_reading_every_use_never_waits_on_a_stale_phase_and_finishes(block):
    for slots, heads, items, seed in list(cases(400))[block * 100:(block + 1) * 100]:
        assert run(slots, heads, 1, items, seed) == ("ok", False), (slots, heads, items, seed)


def test_two_warps_per_head_skipping_each_others_uses_can_wait_on_a_stale_phase():
    results = [run(slots, heads, 2, items, seed) for slots, heads, items, seed in cases(200)]
    assert any(stale for _, stale in results)
    assert any(status == "deadlock" for status, _ in results)
