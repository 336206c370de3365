"""Llama / Qwen2 / Qwen3 against HF transformers over configurations test_llama_parity.py does not
build: head dims 24/32/64/80/96/128/256 (explicit ones that differ from hidden / heads), MQA and
MHA next to GQA and three query heads per kv head, rope thetas far from 1e4, every accepted rope
scaling type in a second form (yarn with mscale / attention_factor / betas / no truncation,
dynamic in the legacy form, llama3 on a large head, linear below 1), tied heads, Qwen2's q/k/v
bias, Qwen3's q/k norm with and without bias, and checkpoints stored in float16 and bfloat16,
computed in their own dtype.

Each configuration runs two steps over one paged sequence: the prompt as one prefill, then HF's
greedy continuation as a chunk that reads the prompt from the cache. Teacher-forced on HF's tokens,
our argmax at every position must be HF's token (so greedy decoding gives HF's tokens) and our
logprobs must be close to HF's. Half-precision checkpoints are compared with HF in the same dtype;
there two rounding orders may split a near-tie, so a token may differ only where HF's own top two
are closer than the tolerance.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from model import base
from model.base import ModelOptions
from model.config import ModelConfig
from model.loader import load_model
from model.testing import SeqChunk, hf_greedy, hf_load, hf_logits, make_batch, write_tiny_checkpoint

BLOCK = 16
PROMPT, NEW = 40, 6
TOKENS, BLOCKS = 48, 3  # one padded shape for both steps: each model compiles once
# Max |logprob difference| to HF in the checkpoint's dtype. bf16 is HF's own distance to f32 on
# these models (measured 0.026-0.038 for both HF and us over 70 positions), with a margin.
TOLERANCE = {"float32": 1e-4, "float16": 0.02, "bfloat16": 0.08}
LLAMA3 = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0)
CASES = {
    # MQA, head_dim 128 with hidden 64, theta of Llama 3
    "llama_mqa_hd128_theta5e5": (
        "llama",
        "float32",
        dict(
            head_dim=128,
            num_key_value_heads=1,
            rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        ),
    ),
    # MHA on head_dim 80, yarn through mscale / mscale_all_dim
    "llama_mha_hd80_yarn_mscale": (
        "llama",
        "float32",
        dict(
            head_dim=80,
            num_key_value_heads=4,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
            },
        ),
    ),
    # head_dim 64 derived (2 heads of a 128 hidden), linear factor below 1, biases, tied
    "llama_hd64_linear_half_tied_bias": (
        "llama",
        "float32",
        dict(
            hidden_size=128,
            num_attention_heads=2,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 100.0, "factor": 0.5},
        ),
    ),
    # Qwen2: MQA on head_dim 32, tied, dynamic rope in the legacy rope_scaling form
    "qwen2_mqa_hd32_dynamic_legacy_tied": (
        "qwen2",
        "float32",
        dict(
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_theta=1e6,
            rope_scaling={"type": "dynamic", "factor": 4.0},
        ),
    ),
    # Qwen3: MHA on head_dim 64, q/k/v/o bias beside q/k norm, yarn with explicit factors
    "qwen3_mha_hd64_bias_yarn_explicit": (
        "qwen3",
        "float32",
        dict(
            head_dim=64,
            num_key_value_heads=4,
            attention_bias=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 2.0,
                "original_max_position_embeddings": 64,
                "attention_factor": 1.3,
                "beta_fast": 16,
                "beta_slow": 2,
                "truncate": False,
            },
        ),
    ),
    # bfloat16 checkpoint: head_dim 96, llama3 rope past its original context
    "llama_bf16_hd96_llama3": (
        "llama",
        "bfloat16",
        dict(
            head_dim=96,
            rope_parameters={
                **LLAMA3,
                "rope_theta": 5e5,
                "factor": 8.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # float16 checkpoints: Qwen2 MHA head_dim 32, and Qwen3 head_dim 128 with llama3 rope
    "qwen2_fp16_mha_hd32": (
        "qwen2",
        "float16",
        dict(num_attention_heads=2, num_key_value_heads=2),
    ),
    "qwen3_fp16_hd128_llama3": (
        "qwen3",
        "float16",
        dict(
            head_dim=128,
            rope_parameters={
                **LLAMA3,
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    # Head dim 24 (no C++ kernel serves it: the jnp paths), eight heads of their own
    "llama_mha8_hd24": (
        "llama",
        "float32",
        dict(num_attention_heads=8, num_key_value_heads=8, head_dim=24),
    ),
    # Qwen3 MQA on head_dim 256, theta 1e7
    "qwen3_mqa_hd256_theta1e7": (
        "qwen3",
        "float32",
        dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, rope_theta=1e7),
    ),
    # Three query heads per kv head, theta 500
    "llama_g3_hd32_theta500": (
        "llama",
        "float32",
        dict(
            hidden_size=96,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=32,
            rope_theta=500.0,
        ),
    ),
}

OPTIONS = ModelOptions(block_size=BLOCK)
FORWARD = jax.jit(base.forward, donate_argnums=2)
LOGITS = jax.jit(base.compute_logits)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def _our_logprobs(path: str, tokens: list[int], dtype: str) -> np.ndarray:
    """Logprobs [len(tokens), vocab]: step 1 the prompt, step 2 the rest from the paged cache."""
    graphdef, state = load_model(path, ModelConfig.from_pretrained(path, dtype=dtype), OPTIONS)
    model = nnx.merge(graphdef, state)
    kv = base.allocate(type(model).cache_specs(model.config, OPTIONS), BLOCKS + 1)
    table = tuple(range(1, BLOCKS + 1))
    rows = []
    for start, end in ((0, PROMPT), (PROMPT, len(tokens))):
        chunk = SeqChunk(tuple(tokens[start:end]), start, table)
        batch = make_batch([chunk], BLOCK, num_tokens=TOKENS, num_seqs=1, max_blocks=BLOCKS)
        kv, hidden = FORWARD(graphdef, state, kv, batch)
        rows.append(np.asarray(LOGITS(graphdef, state, hidden))[: end - start])
    return _log_softmax(np.concatenate(rows))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """name -> (dtype, the token each row predicts, HF's logprobs, ours) over prompt + HF's greedy."""
    root = tmp_path_factory.mktemp("sweep")
    prompt = np.random.default_rng(0).integers(3, 128, PROMPT).tolist()
    out = {}
    for seed, (name, (arch, dtype, overrides)) in enumerate(CASES.items()):
        path = write_tiny_checkpoint(root / name, arch, seed=seed, dtype=dtype, **overrides)
        hf = hf_load(path, dtype)
        new = hf_greedy(hf, prompt, NEW)
        tokens = prompt + new
        # Row i predicts token i + 1; the last row predicts past the compared tokens.
        want = _log_softmax(hf_logits(hf, tokens))[:-1]
        ours = _our_logprobs(path, tokens, dtype)[:-1]
        out[name] = (dtype, tokens[1:], want, ours)
    return out


def test_config_sweep_matches_hf(results):
    for name, (dtype, next_tokens, want, ours) in results.items():
        tol = TOLERANCE[dtype]
        diff = np.abs(ours - want).max()
        assert diff < tol, f"{name}: max |logprob - HF| {diff:.2e} >= {tol}"
        # The rows from PROMPT - 1 on predict HF's greedy tokens.
        greedy = np.asarray(next_tokens[PROMPT - 1 :])
        ours_greedy = ours[PROMPT - 1 :].argmax(-1)
        top2 = np.sort(want[PROMPT - 1 :], axis=-1)[:, -2:]
        near_tie = (top2[:, 1] - top2[:, 0] < tol) if dtype != "float32" else False
        differ = np.flatnonzero((ours_greedy != greedy) & ~near_tie)
        assert differ.size == 0, (
            f"{name}: greedy tokens {ours_greedy.tolist()} vs HF {greedy.tolist()} "
            f"(differ at {differ.tolist()})"
        )
