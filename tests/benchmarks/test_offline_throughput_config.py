"""benchmarks/offline_throughput.py --family: each family's benchmark model is the one its docstring
describes, and its KV bytes per token come from the cache specs vlax allocates. Nothing is run or
loaded: the models are built on the meta device."""

import pytest

from benchmarks import offline_throughput as bench


def _params(family):
    import torch

    with torch.device("meta"):
        model = bench.hf_model(family)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, experts


def test_deepseek_v32_family_builds_its_config():
    config = bench.hf_config("deepseek_v32")
    assert type(config).__name__ == "DeepseekV32Config"
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts) == (
        8,
        2,
        1,
    )
    assert config.index_topk == 256 and config.q_lora_rank is not None
    assert config.hidden_size == bench.CONFIG["hidden_size"]  # compared with the Llama's
    assert config.vocab_size == bench.CONFIG["vocab_size"]  # so the workload's ids are valid
    total, experts = _params("deepseek_v32")
    assert 45e6 < total < 60e6 and experts > 0  # "about 50M parameters"
    assert 45e6 < _params("llama")[0] < 60e6


def test_kv_bytes_per_token_are_the_cache_specs():
    deepseek = bench.kv_bytes_per_token("deepseek_v32", "float32")
    c = bench.DEEPSEEK_V32_CONFIG
    layers = c["num_hidden_layers"]
    latent = layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 4
    keys = layers * c["index_head_dim"] * 4
    assert deepseek == {
        "total": latent + keys,
        "pools": {"MLA latent": latent, "DSA indexer keys": keys},
    }
    llama = bench.kv_bytes_per_token("llama", "bfloat16")
    head_dim = bench.CONFIG["hidden_size"] // bench.CONFIG["num_attention_heads"]
    want = (
        bench.CONFIG["num_hidden_layers"] * 2 * bench.CONFIG["num_key_value_heads"] * head_dim * 2
    )
    assert llama == {"total": want, "pools": {"attention K/V": want}}


def test_family_flag_and_its_default_dtypes():
    assert bench.FAMILIES["deepseek_v32"][3] == "float32"
    with pytest.raises(SystemExit):
        bench.main(["--family", "deepseek_v4"])
