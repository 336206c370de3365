"""Llama / Qwen2 / Qwen3 forward over the paged ragged batch against HF transformers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import base
from model.base import ModelOptions
from model.config import ModelConfig
from model.loader import load_model
from model.testing import (
    SeqChunk,
    hf_greedy,
    hf_load,
    hf_logits,
    make_batch,
    run_schedule,
    scattered_block_tables,
    write_tiny_checkpoint,
)

BLOCK = 4
T, S, MB = 32, 4, 8  # one padded shape for every step, so each model compiles once
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
CASES = {
    # GQA ratio 2, default rope, untied head
    "llama_gqa2": ("llama", {}),
    # MHA (ratio 1), head_dim 32 != hidden / heads, tied embeddings, llama3 rope
    "llama_mha_llama3_tied": (
        "llama",
        dict(num_key_value_heads=4, head_dim=32, tie_word_embeddings=True, rope_parameters=LLAMA3),
    ),
    # GQA ratio 4, linear rope in the pre-5.x `rope_scaling` + `rope_theta` form, all biases
    "llama_gqa4_linear_bias": (
        "llama",
        dict(
            num_key_value_heads=1,
            attention_bias=True,
            mlp_bias=True,
            rope_theta=500.0,
            rope_scaling={"type": "linear", "factor": 2.0},
        ),
    ),  # fmt: skip
    # qkv bias, yarn rope, tied
    "qwen2_yarn_tied": (
        "qwen2",
        dict(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),  # fmt: skip
    # sliding window on the second layer only
    "qwen2_sliding": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    # q/k norm, 8 heads / 2 kv (ratio 4), dynamic rope, attention bias
    "qwen3_gqa4_dynamic": (
        "qwen3",
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            attention_bias=True,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
        ),
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {
        name: write_tiny_checkpoint(root / name, arch, seed=i, **ov)
        for i, (name, (arch, ov)) in enumerate(CASES.items())
    }


NUM_BLOCKS = 40
# Shared by every test: jit caches per (graphdef, shapes), so each model compiles once per module.
FORWARD = jax.jit(base.forward, donate_argnums=2)
LOGITS = jax.jit(base.compute_logits)
OPTIONS = ModelOptions(block_size=BLOCK)


@pytest.fixture(scope="module")
def models(checkpoints):
    return {name: _load(path) for name, path in checkpoints.items()}


def _load(path, dtype="float32"):
    graphdef, state = load_model(path, ModelConfig.from_pretrained(path, dtype=dtype), OPTIONS)
    return graphdef, state


def _caches(graphdef, state, num_blocks=NUM_BLOCKS, options=OPTIONS):
    model = nnx.merge(graphdef, state)
    return base.allocate(type(model).cache_specs(model.config, options), num_blocks)


def _ragged_logits(graphdef, state, tokens):
    """Run a 3-step mixed schedule; returns {seq: {position: logits}} for every computed token.

    step 1: A prefill chunk 0..13, B prefill 0..7, D prefill 0..5
    step 2: A prefill chunk 13..23 (same cache), B decode, C prefill 0..17, D decode
    step 3: decode A, B, C, D
    """
    kv = _caches(graphdef, state)
    tables = dict(zip("ABCD", scattered_block_tables([25, 10, 19, 8], BLOCK, seed=3), strict=True))
    steps = [
        [("A", 0, 13), ("B", 0, 7), ("D", 0, 5)],
        [("A", 13, 23), ("B", 7, 8), ("C", 0, 17), ("D", 5, 6)],
        [("A", 23, 24), ("B", 8, 9), ("C", 17, 18), ("D", 6, 7)],
    ]
    _, got = run_schedule(
        FORWARD,
        LOGITS,
        graphdef,
        state,
        kv,
        tokens,
        tables,
        steps,
        BLOCK,
        num_tokens=T,
        num_seqs=S,
        max_blocks=MB,
    )
    return got


def _tokens(seed):
    rng = np.random.default_rng(seed)
    return {
        s: rng.integers(3, 128, n).tolist() for s, n in zip("ABCD", (24, 9, 18, 7), strict=True)
    }


def test_ragged_chunked_prefill_and_decode_logits_match_hf(checkpoints, models):
    for i, (name, path) in enumerate(checkpoints.items()):
        tokens = _tokens(i)
        got = _ragged_logits(*models[name], tokens)
        hf = hf_load(path)
        for s, toks in tokens.items():
            want = hf_logits(hf, toks)
            ours = np.stack([got[s][p] for p in range(len(toks))])
            np.testing.assert_allclose(ours, want, atol=1e-4, rtol=1e-4, err_msg=f"{name} seq {s}")


def test_bfloat16_logits_close_to_hf_bfloat16(checkpoints, tmp_path):
    # An f32 checkpoint cast at load, and a checkpoint stored in bf16 (read through the BF16 path).
    bf16_ckpt = write_tiny_checkpoint(tmp_path / "bf16", "qwen3", seed=7, dtype="bfloat16")
    for path, dtype in ((checkpoints["llama_gqa2"], "bfloat16"), (bf16_ckpt, "auto")):
        tokens = _tokens(11)
        got = _ragged_logits(*_load(path, dtype), tokens)
        hf = hf_load(path, "bfloat16")
        for s, toks in tokens.items():
            want = hf_logits(hf, toks)
            ours = np.stack([got[s][p] for p in range(len(toks))])
            scale = np.abs(want).max()
            assert np.abs(ours - want).max() < 0.03 * scale, (path, s, np.abs(ours - want).max())


def _greedy_paged(graphdef, state, prompts, n_new):
    kv = _caches(graphdef, state)
    tables = scattered_block_tables([len(p) + n_new for p in prompts], BLOCK, seed=5)
    seqs = [list(p) for p in prompts]
    chunks = [SeqChunk(tuple(p), 0, tb) for p, tb in zip(prompts, tables, strict=True)]
    for _ in range(n_new):
        batch = make_batch(chunks, BLOCK, num_tokens=T, num_seqs=S, max_blocks=MB)
        kv, hidden = FORWARD(graphdef, state, kv, batch)
        logits = np.asarray(LOGITS(graphdef, state, hidden))
        nxt = logits[np.asarray(batch.logits_indices)[: len(prompts)]].argmax(-1)
        for seq, t in zip(seqs, nxt, strict=True):
            seq.append(int(t))
        chunks = [SeqChunk((q[-1],), len(q) - 1, tb) for q, tb in zip(seqs, tables, strict=True)]
    return [q[len(p) :] for q, p in zip(seqs, prompts, strict=True)]


def test_greedy_decode_matches_hf_generate(checkpoints, models):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, n).tolist() for n in (5, 11, 3)]
    n_new = 8
    for name, path in checkpoints.items():
        ours = _greedy_paged(*models[name], prompts, n_new)
        hf = hf_load(path)
        want = [hf_greedy(hf, p, n_new) for p in prompts]
        assert all(len(w) == n_new for w in want), want
        assert ours == want, name


def test_kv_cache_is_one_paged_kv_pool_of_its_stated_size(models):
    graphdef, state = models["llama_mha_llama3_tied"]  # head_dim 32, 4 kv heads, 2 layers
    model = nnx.merge(graphdef, state)
    for cache_dtype in (None, "bfloat16"):
        options = ModelOptions(block_size=BLOCK, cache_dtype=cache_dtype)
        (spec,) = type(model).cache_specs(model.config, options)
        assert (spec.num_layers, spec.parts, spec.page_shape) == (2, ("k", "v"), (BLOCK, 4, 32))
        kv = _caches(graphdef, state, 3, options)
        assert len(kv) == 2 and kv[0][0].shape == (3, BLOCK, 4, 32)
        assert kv[0][0].dtype == (model.config.jnp_dtype if cache_dtype is None else jnp.bfloat16)
        itemsize = kv[0][0].dtype.itemsize
        assert spec.bytes_per_block == 2 * 2 * BLOCK * 4 * 32 * itemsize
        assert sum(a.nbytes for pair in kv for a in pair) == 3 * spec.bytes_per_block
    batch = make_batch([SeqChunk((5, 6), 0, (1,))], BLOCK)
    with pytest.raises(ValueError, match="1 KV cache layers for 2 attention layers"):
        base.forward(graphdef, state, _caches(graphdef, state, 4)[:1], batch)
