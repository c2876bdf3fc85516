"""The `cuda_bulk` ring's shape on the host side: its slots, the shared memory they take, and
when a GPU's shared memory is too small for it. The kernel itself runs only on a Hopper GPU
(tests/gpu/test_kernels_gpu.py)."""

import pytest
import torch

from nanosched.kernels import decode_attn_bulk as bulk

H100_OPTIN = 227 * 1024  # shared memory a block may opt into on an H100 / H200


def test_llama3_heads_get_six_slots_of_a_pages_k_or_v():
    slots = bulk.ring_slots(8, 128, H100_OPTIN)
    assert (slots, bulk.slot_bytes(8, 128), bulk.page_slots(128)) == (6, 32 * 1024, 2)
    assert bulk.smem_bytes(8, 128) == bulk.smem_bytes(8, 128, slots) <= H100_OPTIN
    # all of the ring but the slot being read can be in flight: more than three pages' 128 KB
    assert (slots - 1) * bulk.slot_bytes(8, 128) > 128 * 1024


@pytest.mark.parametrize("kv, d", [(1, 64), (2, 256), (4, 128), (8, 64), (8, 128), (16, 64)])
def test_the_ring_takes_its_bytes_and_at_least_two_pages_within_shared_memory(kv, d):
    slots, size = bulk.ring_slots(kv, d, H100_OPTIN), bulk.slot_bytes(kv, d)
    need = bulk.MIN_RING_PAGES * bulk.page_slots(d)
    assert need <= slots and bulk.smem_bytes(kv, d, slots) <= H100_OPTIN
    assert slots * size <= max(bulk.RING_BYTES, need * size)


@pytest.mark.parametrize("kv, d", [(16, 128), (8, 256)])
def test_heads_whose_two_pages_do_not_fit_get_no_ring(kv, d):
    assert bulk.ring_slots(kv, d, H100_OPTIN) == 0
    assert bulk.smem_bytes(kv, d, bulk.MIN_RING_PAGES * bulk.page_slots(d)) > H100_OPTIN


@pytest.mark.parametrize("boxes", [None, 1, 2, 4])
def test_a_page_fills_a_whole_number_of_slots(monkeypatch, boxes):
    monkeypatch.setattr(bulk, "SLOT_BOXES", boxes)
    for d in (128,) if boxes else (64, 128, 256):
        assert bulk.page_slots(d) * bulk.slot_boxes(d) == 2 * d // 64


def test_the_reason_names_the_shared_memory_the_ring_needs(monkeypatch):
    monkeypatch.setattr(bulk, "_device_limits", lambda index: (9, 100 * 1024))
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    why = bulk.unsupported(q, k, torch.zeros_like(k))
    assert "shared memory" in why and str(bulk.smem_bytes(8, 128, 4)) in why



def test_an_fp8_ring_takes_six_slots_of_a_pages_k_or_v_and_its_scales_in_half_an_sm():
    """FP8, Llama-3 heads: a slot is a page's 16 KB of K (or V) and its 512 B of scales, 1024-byte
    aligned. On few SMs two CTAs share an SM, each with six slots (three pages) in its half of
    the SM's 228 KB; one CTA alone (on the whole GPU, under a CTA bound) takes eleven,
    RING_BYTES' worth."""
    size = bulk.slot_bytes(8, 128, fp8=True)
    assert size == 17 * 1024 and bulk.page_slots(128, fp8=True) == 2
    assert bulk.ctas_per_sm(True, 32) == 2 and bulk.ctas_per_sm(False, 32) == 1
    assert bulk.ctas_per_sm(True, 132) == 1  # the whole GPU: one CTA, the whole ring
    half = bulk.cta_smem(H100_OPTIN, 2)
    assert 2 * (half + 1024) <= bulk.SM_SMEM and bulk.cta_smem(H100_OPTIN, 1) == H100_OPTIN
    slots = bulk.ring_slots(8, 128, half, fp8=True)
    assert slots == 6 and bulk.smem_bytes(8, 128, 6, fp8=True) == 6 * size + 1024 + 16 * 6 <= half
    assert bulk.ring_slots(8, 128, H100_OPTIN, fp8=True) == 11
    assert bulk.smem_bytes(8, 128, fp8=True) == 11 * size + 1024 + 16 * 11
