"""ModelConfig: architecture registry, runner type, dtype policy, rope forms, clear errors."""

from __future__ import annotations

import json

import pytest

from model.config import ConfigError, ModelConfig, from_hf_dict
from model.registry import supported_architectures

BASE = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def cfg(**kw):
    return from_hf_dict({**BASE, **kw})


def test_reads_a_transformers_written_config(tmp_path):
    from model.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "q3", "qwen3", tie_word_embeddings=True)
    c = ModelConfig.from_pretrained(path)
    assert (c.architecture, c.model_type, c.runner_type) == (
        "Qwen3ForCausalLM",
        "qwen3",
        "generate",
    )
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.dtype == "bfloat16" and c.tie_word_embeddings  # float32 written, auto downcasts
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1 and c.pad_token_id == 0
    assert c.rope.rope_type == "default" and c.rope.theta == 10000.0
    assert c.sliding_windows == (None, None)
    assert c.hf_config["hidden_size"] == 64


def test_unsupported_architecture_lists_the_supported_ones():
    for archs in (["GPT2LMHeadModel"], [], None):
        with pytest.raises(ConfigError) as e:
            cfg(architectures=archs)
        msg = str(e.value)
        assert all(name in msg for name in supported_architectures()), msg
        if archs:
            assert "GPT2LMHeadModel" in msg


def test_first_supported_of_several_architectures_is_chosen():
    assert cfg(architectures=["Foo", "Qwen2ForCausalLM"]).architecture == "Qwen2ForCausalLM"


def test_inconsistent_head_counts_are_rejected_naming_the_values():
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\).*num_key_value_heads \(3\)"):
        cfg(num_key_value_heads=3)
    with pytest.raises(ConfigError, match=r"hidden_size \(66\).*num_attention_heads \(4\)"):
        cfg(hidden_size=66)
    assert cfg(hidden_size=66, head_dim=16).head_dim == 16  # explicit head_dim wins
    assert cfg(num_key_value_heads=None).num_key_value_heads == 4  # MHA default
    with pytest.raises(ConfigError, match="num_key_value_heads must be a positive int, got 0"):
        cfg(num_key_value_heads=0)
    for bad in (0, -2, "4"):
        with pytest.raises(ConfigError, match="num_attention_heads"):
            cfg(num_attention_heads=bad)
    with pytest.raises(ConfigError, match="head_dim"):
        cfg(head_dim=15)
    with pytest.raises(ConfigError, match="vocab_size"):
        cfg(vocab_size=None)
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        cfg(hidden_act="gelu")


def test_dtype_policy():
    """vLLM 0.33's "auto": a bfloat16 or float16 checkpoint keeps its dtype; a float32 one (or
    one recording none) is downcast, to float16 for a pooling model and bfloat16 otherwise; a
    model type float16 makes unstable never gets float16."""
    assert cfg().dtype == "bfloat16"  # no dtype recorded: float32, downcast
    assert cfg(dtype="float32").dtype == "bfloat16"
    assert from_hf_dict({**BASE, "dtype": "float32"}, runner="pooling").dtype == "float16"
    assert cfg(dtype="bfloat16").dtype == "bfloat16"  # transformers 5.x key
    assert cfg(torch_dtype="float16").dtype == "float16"  # legacy key
    unstable = {**BASE, "model_type": "gemma2", "torch_dtype": "float16"}
    assert from_hf_dict(unstable, runner="pooling").dtype == "bfloat16"
    with pytest.raises(ConfigError, match="model_type 'gemma2' does not support float16"):
        from_hf_dict(unstable, dtype="float16")
    assert from_hf_dict({**BASE, "dtype": "bfloat16"}, dtype="float32").dtype == "float32"
    assert from_hf_dict(BASE, dtype="bfloat16").jnp_dtype.name == "bfloat16"
    with pytest.raises(ConfigError, match="'int8'"):
        from_hf_dict(BASE, dtype="int8")
    with pytest.raises(ConfigError, match="'float8_e4m3'"):
        cfg(dtype="float8_e4m3")


def test_runner_type():
    assert cfg().runner_type == "generate"
    assert from_hf_dict(BASE, runner="generate").runner_type == "generate"
    # A decoder served as an embedder pools its last token (tests/model/test_routing.py).
    pooled = from_hf_dict(BASE, runner="pooling")
    assert (pooled.runner_type, pooled.pooling_type) == ("pooling", "LAST")
    with pytest.raises(ConfigError, match="'embed'"):
        from_hf_dict(BASE, runner="embed")


def test_generation_config_overrides_eos_and_gives_sampling_defaults(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2}))
    gen = {"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    c = ModelConfig.from_pretrained(tmp_path)
    assert c.eos_token_ids == (2, 7)
    assert dict(c.generation_defaults) == {"temperature": 0.6, "top_p": 0.9}
    assert hash(c)  # a value type: usable as a static jit argument


def test_missing_or_broken_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


def test_rope_forms_v5_and_legacy_agree():
    v5 = cfg(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}).rope
    legacy = cfg(rope_theta=500.0, rope_scaling={"type": "linear", "factor": 2.0}).rope
    assert v5 == legacy and v5.factor == 2.0 and v5.theta == 500.0
    l3 = cfg(
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 5e5}
    ).rope  # fmt: skip
    assert (l3.rope_type, l3.original_max_position_embeddings, l3.theta) == ("llama3", 64, 5e5)
    yarn = cfg(rope_parameters={"rope_type": "yarn", "original_max_position_embeddings": 64}).rope
    assert yarn.factor == 4.0  # implied by max_position_embeddings / original
    with pytest.raises(ConfigError, match="'longrope'.*supported"):
        cfg(rope_parameters={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ConfigError, match="needs a 'factor'"):
        cfg(rope_parameters={"rope_type": "linear"})
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        cfg(partial_rotary_factor=0.5)


def test_rope_numbers_missing_or_not_numbers_are_config_errors_naming_the_key():
    # These raised a bare KeyError / TypeError from deep inside the parser.
    with pytest.raises(ConfigError, match="'llama3' needs 'low_freq_factor'"):
        cfg(rope_parameters={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ConfigError, match="'factor' must be a number, got 'x'"):
        cfg(rope_parameters={"rope_type": "linear", "factor": "x"})
    with pytest.raises(ConfigError, match="'high_freq_factor' must be a number, got '4'"):
        cfg(
            rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": "4"}
        )  # fmt: skip


def test_sliding_windows_per_layer():
    c = cfg(sliding_window=8, layer_types=["full_attention", "sliding_attention"])
    assert c.sliding_windows == (None, 8)
    # Qwen2-style: the window is off unless use_sliding_window
    off = cfg(use_sliding_window=False, sliding_window=8, layer_types=["full_attention"] * 2)
    assert off.sliding_windows == (None, None)
    with pytest.raises(ConfigError, match="2 entries for 3 layers"):
        cfg(num_hidden_layers=3, layer_types=["full_attention"] * 2)
    with pytest.raises(ConfigError, match="'chunked_attention'"):
        cfg(layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ConfigError, match="sliding_window=None"):
        cfg(layer_types=["full_attention", "sliding_attention"])


def test_unserved_deepseek_v4_and_quantized_checkpoints_name_the_field():
    with pytest.raises(
        ConfigError, match=r"'model_type' = 'deepseek_v4': DeepSeek-V4 is not served"
    ):
        cfg(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v4")
    with pytest.raises(
        ConfigError, match=r"'architectures' names 'DeepseekV4ForCausalLM': DeepSeek-V4 is not"
    ):
        cfg(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v3")
    # DeepSeek-V3's released config.json carries this block.
    fp8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}
    with pytest.raises(ConfigError) as e:
        cfg(quantization_config=fp8)
    assert "'quantization_config.quant_method' = 'fp8'" in str(e.value)
    assert "FP8 weights have no dequantization path" in str(e.value)
    with pytest.raises(ConfigError, match=r"quant_method' = 'awq': quantized checkpoints"):
        cfg(quantization_config={"quant_method": "awq", "bits": 4})


def test_qwen3_without_head_dim_takes_hfs_default_of_128():
    qwen3 = {**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    assert from_hf_dict(qwen3).head_dim == 128
    assert from_hf_dict({**qwen3, "head_dim": 16}).head_dim == 16
    assert cfg().head_dim == 16  # Llama: hidden / heads
