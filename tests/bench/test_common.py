"""bench/_common.py's pricing helpers that need no GPU."""

from types import SimpleNamespace

from bench._common import context_clamp


def test_context_clamp_keeps_a_context_within_the_ops_measured_ones():
    rows = [SimpleNamespace(op="attn_prefill", context=1000),
            SimpleNamespace(op="attn_decode", context=500),
            SimpleNamespace(op="attn_decode", context=2000),
            SimpleNamespace(op="ug", context=0)]
    within = context_clamp(SimpleNamespace(kernels=rows))
    assert within("attn_prefill", 976) == 1000 and within("attn_prefill", 1200) == 1000
    assert within("attn_decode", 1415.5) == 1415.5
    assert within("attn_decode", 100) == 500 and within("attn_decode", 5000) == 2000
    assert within("ug", 300) == 300 and within("rope_append", 7) == 7  # no context rows
    assert within("attn_decode", None) is None
