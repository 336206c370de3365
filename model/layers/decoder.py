"""The decoder stack HF's decoder-only families share (Llama and Qwen, DeepSeek, Kimi-Linear, Gemma):
token embeddings, pre-norm residual layers, a final norm, and an LM head that is the embedding
table (tied) or its own. Each family builds its layers' attention and MLP and calls them; the
residual wiring and the module names, which are HF's weight names (`model.embed_tokens`,
`model.layers.N.input_layernorm`, `.self_attn`, `.post_attention_layernorm`, `.mlp`,
`model.norm`, `lm_head`), are written here once.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from model.config import ModelConfig
from model.layers.embeddings import Embedding, lm_logits
from model.layers.norms import RMSNorm


class PreNormLayer(nnx.Module):
    """x + attention(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)). A family's
    layer subclasses it and calls `residual` with how its attention runs on the normed x."""

    def __init__(self, cfg: ModelConfig, attention: nnx.Module, mlp: nnx.Module, norm=RMSNorm):
        dt = cfg.jnp_dtype
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.self_attn = attention
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.mlp = mlp

    def residual(
        self, x: jax.Array, attend: Callable[[jax.Array], tuple], rows: jax.Array | None = None
    ) -> tuple:
        """(layer output, cache entry); `attend(h)` gives (attention output, cache entry).
        `rows`: only these rows of the output (the last layer of a step that needs the final
        hidden state of a few rows: the MLP, most of a layer's cost, runs on those alone)."""
        h, entry = attend(self.input_layernorm(x))
        x = x + h
        if rows is not None:
            x = x[rows]
        return x + self.mlp(self.post_attention_layernorm(x)), entry


class DecoderStack(nnx.Module):
    """Embeddings, decoder layers and the final norm: HF's `<Family>Model`, under `model.`."""

    def __init__(self, cfg: ModelConfig, layers: list[nnx.Module], norm=RMSNorm):
        dt = cfg.jnp_dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dt)
        self.layers = nnx.List(layers)
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps, dt)


def own_lm_head(cfg: ModelConfig) -> Embedding | None:
    """The LM head's table, or None when it is tied to the embeddings."""
    if cfg.tie_word_embeddings:
        return None
    return Embedding(cfg.vocab_size, cfg.hidden_size, cfg.jnp_dtype)


def head_logits(stack: DecoderStack, lm_head: Embedding | None, hidden_rows: jax.Array):
    """f32 logits of the final hidden rows, through the LM head or the tied embeddings."""
    head = stack.embed_tokens if lm_head is None else lm_head
    return lm_logits(hidden_rows, head.weight[...])
