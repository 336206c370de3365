"""Rotary frequencies and rotation against transformers' own implementations, at real-model sizes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from model.config import from_hf_dict
from model.layers.rotary import apply_rotary, inv_freq_and_scale, rotary_cos_sin

ROPES = [
    {"rope_type": "default", "rope_theta": 500000.0},
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
     "rope_theta": 1e6},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
     "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1, "rope_theta": 1e4},
]  # fmt: skip


def _hf_config(rope):
    return LlamaConfig(
        hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=131072, rope_parameters=dict(rope),
    )  # fmt: skip


def test_inverse_frequencies_and_scale_match_transformers():
    for rope in ROPES:
        hf_cfg = _hf_config(rope)
        ours = from_hf_dict({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]}).rope
        inv, scale = inv_freq_and_scale(ours)
        if rope["rope_type"] == "default":
            want, want_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
        else:
            want, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
        np.testing.assert_allclose(inv, want.numpy(), rtol=3e-7, err_msg=str(rope))
        np.testing.assert_allclose(scale, want_scale, rtol=1e-6, err_msg=str(rope))


def test_rotation_matches_transformers_apply_rotary_pos_emb():
    rng = np.random.default_rng(0)
    positions = np.array([0, 1, 7, 300, 4095, 70000], np.int32)
    q = rng.standard_normal((6, 8, 128), np.float32)
    k = rng.standard_normal((6, 2, 128), np.float32)
    for rope in ROPES[3:]:
        hf_cfg = _hf_config(rope)
        ours = from_hf_dict({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]}).rope
        cos, sin = rotary_cos_sin(jnp.asarray(positions), ours, jnp.float32)
        got_q, got_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1), torch.tensor(positions[None]))
        want_q, want_k = apply_rotary_pos_emb(
            torch.tensor(q)[None].transpose(1, 2),
            torch.tensor(k)[None].transpose(1, 2),
            hf_cos,
            hf_sin,
        )
        # large positions amplify 1-ulp angle differences: compare at f32 trig accuracy
        np.testing.assert_allclose(got_q, want_q[0].transpose(0, 1).numpy(), atol=2e-4)
        np.testing.assert_allclose(got_k, want_k[0].transpose(0, 1).numpy(), atol=2e-4)


def test_cos_and_sin_are_evaluated_once_per_step_not_once_per_layer():
    """The scenario that cost a 2048-token prefill ~22 ms: XLA:CPU fused cos and sin into every
    layer's rotation, evaluating them again per layer (and per element of each head)."""
    import jax

    rope = from_hf_dict(
        {**_hf_config(ROPES[0]).to_dict(), "architectures": ["LlamaForCausalLM"]}
    ).rope
    rng = np.random.default_rng(1)
    qs = [jnp.asarray(rng.standard_normal((64, 8, 128)), jnp.float32) for _ in range(4)]

    def layers(positions, qs):
        cos, sin = rotary_cos_sin(positions, rope, jnp.float32)
        out = jnp.zeros_like(qs[0])
        for q in qs:
            out = apply_rotary(out + q, cos, sin)
        return out

    positions = jnp.arange(64, dtype=jnp.int32)
    text = jax.jit(layers).lower(positions, qs).compile().as_text()
    assert text.count(" cosine(") == 1 and text.count(" sine(") == 1
