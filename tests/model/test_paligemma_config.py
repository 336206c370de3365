"""PaliGemma / ColPali configuration: the language model's settings come from text_config (the
top-level hidden_size of a PaliGemma config.json is a leftover default), Gemma's defaults fill what
a hub checkpoint leaves out, and what is not served is refused by name."""

from __future__ import annotations

import copy

import pytest

from model.config import ConfigError, from_hf_dict
from model.paligemma import _settings

# google/paligemma-3b-pt-224's config.json, as published (no head_dim, max_position_embeddings,
# image_size or special tokens inside text_config).
HUB = {
    "architectures": ["PaliGemmaForConditionalGeneration"],
    "bos_token_id": 2,
    "eos_token_id": 1,
    "hidden_size": 2048,
    "image_token_index": 257152,
    "model_type": "paligemma",
    "pad_token_id": 0,
    "projection_dim": 2048,
    "text_config": {
        "hidden_size": 2048,
        "intermediate_size": 16384,
        "model_type": "gemma",
        "num_attention_heads": 8,
        "num_hidden_layers": 18,
        "num_image_tokens": 256,
        "num_key_value_heads": 1,
        "torch_dtype": "float32",
        "vocab_size": 257216,
    },
    "torch_dtype": "float32",
    "vision_config": {
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "num_image_tokens": 256,
        "patch_size": 14,
        "projection_dim": 2048,
        "projector_hidden_act": "gelu_fast",
        "vision_use_head": False,
    },
    "vocab_size": 257216,
}


def test_hub_paligemma_config():
    c = from_hf_dict(copy.deepcopy(HUB), path="pg")
    assert (c.architecture, c.runner_type, c.attention_type) == (
        "PaliGemmaForConditionalGeneration",
        "generate",
        "causal",
    )
    assert (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads) == (
        2048,
        256,
        8,
        1,
    )
    assert (c.vocab_size, c.max_position_embeddings, c.hidden_act) == (
        257216,
        8192,
        "gelu_pytorch_tanh",
    )
    assert (c.bos_token_id, c.eos_token_ids, c.pad_token_id) == (2, (1,), 0)
    assert c.tie_word_embeddings and c.hf_config["vision_config"]["patch_size"] == 14
    vision, token, proj = _settings(c)
    assert (vision.image_size, vision.num_patches, token, proj) == (224, 256, 257152, 2048)


def test_colpali_nests_paligemma_and_attends_bidirectionally():
    hf = {
        "architectures": ["ColPaliForRetrieval"],
        "model_type": "colpali",
        "embedding_dim": 128,
        "vlm_config": copy.deepcopy(HUB),
    }
    c = from_hf_dict(hf, path="cp")
    assert (c.architecture, c.runner_type, c.attention_type) == (
        "ColPaliForRetrieval",
        "pooling",
        "bidirectional",
    )
    assert "colpali" in c.routing_reasons["attention_type"]
    assert (c.hidden_size, c.head_dim) == (2048, 256)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: h.pop("text_config"), "needs text_config"),
        (lambda h: h["text_config"].update(model_type="gemma2"), "only a 'gemma' language"),
        (lambda h: h["text_config"].update(hidden_act="silu"), "hidden_act 'silu'"),
    ],
    ids=["no text_config", "gemma2", "silu"],
)
def test_refused_configs(edit, message):
    hf = copy.deepcopy(HUB)
    edit(hf)
    with pytest.raises(ConfigError, match=message):
        from_hf_dict(hf, path="pg")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: h.update(projection_dim=1024), "projection_dim 1024 must equal"),
        (lambda h: h["vision_config"].update(vision_use_head=True), "vision_use_head"),
        (lambda h: h["text_config"].update(num_image_tokens=100), "num_image_tokens 100"),
        (lambda h: h.update(image_token_index=300000), "image_token_index"),
        (lambda h: h["vision_config"].update(patch_size=15), "not a multiple of patch_size 15"),
    ],
    ids=["projection", "head", "image tokens", "image token id", "patch"],
)
def test_refused_at_build(edit, message):
    hf = copy.deepcopy(HUB)
    edit(hf)
    with pytest.raises(ConfigError, match=message):
        _settings(from_hf_dict(hf, path="pg"))
