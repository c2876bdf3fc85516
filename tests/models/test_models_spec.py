import json

import pytest

from nanosched.errors import ConfigError
from nanosched.models.ops import layer_ops
from nanosched.models.spec import REGISTRY, load_spec

# Published parameter counts (model cards), in billions.
PUBLISHED = {"llama3-8b": 8.03, "llama3-70b": 70.55, "llama2-70b": 68.98,
             "qwen2.5-72b": 72.71, "deepseek-67b": 67.43, "mixtral-8x7b": 46.70,
             "smollm2-135m": 0.135, "qwen2.5-0.5b": 0.494, "stories15m": 0.015}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts(name):
    assert load_spec(name).num_params() / 1e9 == pytest.approx(PUBLISHED[name], abs=0.01)


def test_registry_has_the_design_models():
    assert set(REGISTRY) == set(PUBLISHED)


def test_unknown_name_lists_known(tmp_path):
    with pytest.raises(ConfigError, match="known models: deepseek-67b, llama2-70b"):
        load_spec("gpt-5")


def _write(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


LLAMA_CFG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
             "vocab_size": 100, "max_position_embeddings": 256, "rope_theta": 10000.0,
             "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu"}


def test_hf_config_folder_and_file(tmp_path):
    spec = load_spec(_write(tmp_path, LLAMA_CFG))
    assert (spec.arch, spec.head_dim, spec.num_kv_heads) == ("llama", 16, 2)
    assert spec.tie_word_embeddings and spec.num_lm_head_params == 0
    # embeddings + 2 layers (attn 64*(64+2*32) + 64*64, mlp 3*64*128, norms 128) + final norm
    per_layer = 64 * 128 + 64 * 64 + 3 * 64 * 128 + 128
    assert spec.num_params() == 100 * 64 + 2 * per_layer + 64
    assert load_spec(str(tmp_path / "config.json")) == spec


def test_hf_qwen_and_mixtral(tmp_path):
    q = load_spec(_write(tmp_path, {**LLAMA_CFG, "architectures": ["Qwen2ForCausalLM"]}))
    assert q.arch == "qwen2" and q.qkv_bias
    m = load_spec(_write(tmp_path, {**LLAMA_CFG, "architectures": ["MixtralForCausalLM"],
                                    "num_local_experts": 4, "num_experts_per_tok": 2}))
    assert m.is_moe and m.num_params(active=True) < m.num_params()


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": None}, "missing field 'hidden_size'"),
    ({"num_hidden_layers": -1}, "num_layers must be a positive integer, got -1"),
    ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ({"architectures": ["GPT2LMHeadModel"]}, "supported: LlamaForCausalLM"),
    ({"hidden_act": "gelu"}, "only 'silu'"),
    ({"architectures": ["MixtralForCausalLM"]}, "missing field 'num_local_experts'"),
])
def test_bad_config_names_the_field(tmp_path, change, message):
    cfg = {**LLAMA_CFG, **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        load_spec(_write(tmp_path, cfg))


def test_bad_json_and_empty_folder(tmp_path):
    with pytest.raises(ConfigError, match="folder has no config.json"):
        load_spec(str(tmp_path))
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_spec(str(tmp_path))


def test_tp_checks():
    spec = load_spec("llama3-70b")
    spec.check_tp(8)
    with pytest.raises(ConfigError, match=r"--tp 3 does not divide .* allowed: 1, 2, 4, 8"):
        spec.check_tp(3)
    with pytest.raises(ConfigError, match="positive integer"):
        spec.check_tp(0)


def test_kv_bytes_replicate_beyond_kv_heads():
    spec = load_spec("llama3-8b")  # 8 KV heads, 32 layers, d=128, bf16
    assert spec.kv_bytes_per_token() == 2 * 8 * 128 * 2 * 32
    assert spec.kv_bytes_per_token(tp=16) == 2 * 1 * 128 * 2 * 32


def test_layer_ops_follow_design():
    names = [op.name for op in layer_ops(load_spec("llama3-70b"), tp=8)]
    assert names == ["kqv", "rope_append", "attn_decode", "attn_prefill", "o", "ar_attn",
                     "add_norm_ffn", "ug", "act", "d", "ar_ffn", "add_norm_attn"]
    assert "ar_attn" not in [op.name for op in layer_ops(load_spec("llama3-8b"), tp=1)]
