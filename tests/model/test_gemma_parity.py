"""GemmaForCausalLM (the text layers PaliGemma and ColPali share) against HF transformers: logits
over a ragged paged batch of prefills and a decode step, at head dim 16 and 256."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from model import base
from model.base import ModelOptions
from model.config import ModelConfig
from model.loader import load_model
from model.testing import SeqChunk, make_batch, scattered_block_tables

BLOCK = 4
PROMPTS = ([2, 17, 40, 9, 88, 3], [2, 5], [2, 99, 12, 64, 33, 8, 71, 20, 3, 10, 11])


@pytest.fixture(scope="module", params=[16, 256], ids=["hd16", "hd256"])
def gemma(request, tmp_path_factory):
    cfg = transformers.GemmaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=request.param,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    hf = transformers.GemmaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every weight random (norm offsets too), N(0, 0.1^2)
        for _, p in hf.named_parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp(f"gemma{request.param}")
    hf.eval().save_pretrained(path)
    config = ModelConfig.from_pretrained(path, dtype="float32")
    options = ModelOptions(block_size=BLOCK)
    graphdef, state = load_model(path, config, options)
    caches = base.allocate(nnx.merge(graphdef, state).cache_specs(config, options), 32)
    return hf, config, graphdef, state, caches


def test_prefill_and_decode_logits_match_hf(gemma):
    hf, config, graphdef, state, caches = gemma
    model = nnx.merge(graphdef, state)
    forward = jax.jit(lambda c, b: nnx.merge(graphdef, state)(c, b))
    tables = scattered_block_tables([len(p) + 1 for p in PROMPTS], BLOCK, seed=2)
    chunks = [SeqChunk(tuple(p), 0, t) for p, t in zip(PROMPTS, tables, strict=True)]
    caches, hidden = forward(
        caches, make_batch(chunks, BLOCK, num_tokens=24, num_seqs=4, max_blocks=4)
    )
    got = np.asarray(model.compute_logits(hidden))
    nxt = [int(np.argmax(got[sum(map(len, PROMPTS[: i + 1])) - 1])) for i in range(len(PROMPTS))]
    off = 0
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            want = hf(torch.tensor([prompt + [nxt[i]]])).logits[0].numpy()
        np.testing.assert_allclose(got[off : off + len(prompt)], want[:-1], atol=1e-4)
        off += len(prompt)
        decode = [SeqChunk((nxt[i],), len(prompt), tables[i])]
        caches, h = forward(
            caches, make_batch(decode, BLOCK, num_tokens=24, num_seqs=4, max_blocks=4)
        )
        np.testing.assert_allclose(np.asarray(model.compute_logits(h[:1]))[0], want[-1], atol=1e-4)
