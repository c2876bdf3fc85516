import pytest

from nanosched.autosearch.opgraph import (
    TokenMix,
    even_split,
    expand,
    layer_graph,
    nano_deps,
)
from nanosched.errors import ConfigError
from nanosched.models.ops import layer_ops
from nanosched.models.spec import load_spec

AR = {"attn": "ar", "ffn": "ar"}


def test_graph_uses_the_layer_ops_and_adds_collective_forms():
    spec = load_spec("llama3-70b")
    g1, g8 = layer_graph(spec, 1), layer_graph(spec, 8)
    assert [o.name for o in g1.ops] == [o.name for o in layer_ops(spec, 1)]
    assert g1.groups() == {}
    assert g8.groups() == {"attn": ("ar", "rs_ag"), "ffn": ("ar", "rs_ag")}
    assert {o.name for o in g8.active_ops(AR)} == {o.name for o in layer_ops(spec, 8)}
    rs = {(e.src, e.dst, e.shift) for e in g8.active_edges({"attn": "rs_ag", "ffn": "rs_ag"})}
    assert {("o", "rs_attn", 0), ("add_norm_ffn", "ag_attn", 0), ("ag_attn", "ug", 0),
            ("ag_ffn", "kqv", 1)} <= rs
    assert ("add_norm_ffn", "ug", 0) not in rs


def test_expand_clips_attention_to_decode_and_prefill_parts():
    g = layer_graph(load_spec("llama3-8b"), 1)
    split = {o.name: [(0, 256), (256, 512)] for o in g.ops}
    nanos = {n.id: n for n in expand(g, split, TokenMix(512, 128, 512), {})}
    assert (nanos["attn_decode.0"].work_start, nanos["attn_decode.0"].work_end) == (0, 128)
    assert "attn_decode.1" not in nanos  # [256, 512) holds no decode tokens
    assert [(nanos[f"attn_prefill.{i}"].work_start, nanos[f"attn_prefill.{i}"].work_end)
            for i in (0, 1)] == [(128, 256), (256, 512)]


def test_deps_follow_intersecting_ranges_and_the_periodic_edge():
    g = layer_graph(load_spec("llama3-8b"), 1)
    split = {o.name: [(0, 256), (256, 512)] for o in g.ops}
    split["o"] = [(0, 128), (128, 384), (384, 512)]
    nanos = expand(g, split, TokenMix(512, 128, 512), {})
    deps = nano_deps(g, nanos, TokenMix(512, 128, 512), {})
    assert deps["kqv.0"] == [("add_norm_attn.0", 1, "data")]
    assert {d[0] for d in deps["o.1"]} == {"attn_prefill.0", "attn_prefill.1"}
    assert {d[0] for d in deps["add_norm_ffn.1"]} == {"o.1", "o.2"}


@pytest.mark.parametrize("prompt_len, expected", [(512, {"rope_append.1", "rope_append.2"}),
                                                  (200, {"rope_append.2"}), (128, set())])
def test_prefill_attention_waits_for_the_earlier_part_of_its_prompt(prompt_len, expected):
    g = layer_graph(load_spec("llama3-8b"), 1)
    split = {o.name: even_split(512, 4) for o in g.ops}
    mix = TokenMix(512, 128, prompt_len)
    deps = nano_deps(g, expand(g, split, mix, {}), mix, {})
    # attn_prefill.2 works on [384, 512); prompts start at 128 and every prompt_len after
    assert {d[0] for d in deps["attn_prefill.2"]} == expected | {"rope_append.3"}


def test_bad_splits_are_refused():
    g = layer_graph(load_spec("llama3-8b"), 1)
    split = {o.name: [(0, 256), (256, 512)] for o in g.ops}
    split["ug"] = [(0, 200), (200, 512)]
    with pytest.raises(ConfigError, match="op 'ug' ranges .* multiples of 128"):
        expand(g, split, TokenMix(512, 128, 512), {})
    with pytest.raises(ConfigError, match="cannot split 256 tokens into 3"):
        even_split(256, 3)


def test_with_forms_keeps_only_the_allowed_collective_forms():
    g = layer_graph(load_spec("llama3-70b"), 8)
    ar = g.with_forms(("ar",))
    assert ar.groups() == {"attn": ("ar",), "ffn": ("ar",)}
    assert not {o.name for o in ar.ops} & {"rs_attn", "ag_attn", "rs_ffn", "ag_ffn"}
    assert set(ar.edges) == set(g.active_edges(AR))  # the all-reduce layer, nothing else
    assert g.with_forms(("ar", "rs_ag")) == g
