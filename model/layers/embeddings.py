"""Token embedding table in HF's [vocab, hidden] layout, also usable as a tied LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import compute
from model.layers.linear import project


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, dim: int, dtype):
        # The table may be kept wider than the model computes (an LM head is a dense weight:
        # model/layers/compute.py); the rows looked up come out in the model's dtype, exactly.
        self.dtype = jnp.dtype(dtype)
        self.weight = nnx.Param(jnp.zeros((vocab_size, dim), compute.weight_dtype(dtype)))

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], token_ids, axis=0).astype(self.dtype)


def lm_logits(hidden: jax.Array, weight: jax.Array) -> jax.Array:
    """hidden [R, H] x weight [V, H] -> f32 logits [R, V], accumulated in f32 and rounded to the
    activation dtype first, as HF's LM head (a bf16 Linear) rounds them before they are cast to
    f32: a bf16 model's greedy choice is made between bf16 logits, ties going to the lower id."""
    return project(hidden, weight).astype(hidden.dtype).astype(jnp.float32)
