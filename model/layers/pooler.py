"""Pooling over a ragged batch: one vector per sequence from its tokens' hidden states.

Pure jnp and jittable; every sequence of the batch is a whole prompt (pooling requests are never
chunked), laid out back to back on the flat token axis by `cu_q_lens`. Padding sequences (index
>= num_seqs, or no tokens) pool to zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

POOLING_TYPES = ("MEAN", "CLS", "LAST")
# torch.nn.functional.normalize's floor on the norm (sentence-transformers' Normalize module).
NORMALIZE_EPS = 1e-12


def pool(
    hidden: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, pooling_type: str
) -> jax.Array:
    """hidden [T, H], cu_q_lens int32[S + 1], num_seqs int32[] -> [S, H] in hidden's dtype.

    MEAN averages each sequence's tokens (in f32); CLS takes its first token, LAST its last.
    """
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {pooling_type!r}")
    num_tokens = hidden.shape[0]
    starts, ends = cu_q_lens[:-1], cu_q_lens[1:]
    lengths = ends - starts
    present = (jnp.arange(starts.shape[0]) < num_seqs) & (lengths > 0)
    if pooling_type == "CLS":
        rows = hidden[jnp.clip(starts, 0, num_tokens - 1)].astype(jnp.float32)
    elif pooling_type == "LAST":
        rows = hidden[jnp.clip(ends - 1, 0, num_tokens - 1)].astype(jnp.float32)
    else:
        # Each token's sequence; tokens past the last sequence get S, which segment_sum drops.
        seq_of_token = jnp.searchsorted(ends, jnp.arange(num_tokens), side="right")
        sums = jax.ops.segment_sum(
            hidden.astype(jnp.float32), seq_of_token, num_segments=starts.shape[0]
        )
        rows = sums / jnp.maximum(lengths, 1)[:, None].astype(jnp.float32)
    return jnp.where(present[:, None], rows, 0.0).astype(hidden.dtype)


def normalize(x: jax.Array) -> jax.Array:
    """L2-normalise the last axis (in f32), as torch.nn.functional.normalize: x / max(|x|, eps)."""
    xf = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True))
    return (xf / jnp.maximum(norm, NORMALIZE_EPS)).astype(x.dtype)
