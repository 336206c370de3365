"""Pooling over a ragged batch: one vector per sequence from its tokens' hidden states.

Pure jnp and jittable; every sequence of the batch is a whole prompt (pooling requests are never
chunked), laid out back to back on the flat token axis by `cu_q_lens`. Padding sequences (index
>= num_seqs, or no tokens) pool to zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

POOLING_TYPES = ("MEAN", "CLS", "LAST")
ONE_ROW = frozenset({"CLS", "LAST"})  # types that pool one token's state per sequence
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
    if pooling_type in ONE_ROW:
        index, present = pooled_rows(cu_q_lens, num_seqs, num_tokens, pooling_type)
        return pool_rows(hidden[index], present)
    starts, ends = cu_q_lens[:-1], cu_q_lens[1:]
    lengths = ends - starts
    present = (jnp.arange(starts.shape[0]) < num_seqs) & (lengths > 0)
    # Each token's sequence; tokens past the last sequence get S, which segment_sum drops.
    seq_of_token = jnp.searchsorted(ends, jnp.arange(num_tokens), side="right")
    sums = jax.ops.segment_sum(
        hidden.astype(jnp.float32), seq_of_token, num_segments=starts.shape[0]
    )
    rows = sums / jnp.maximum(lengths, 1)[:, None].astype(jnp.float32)
    return jnp.where(present[:, None], rows, 0.0).astype(hidden.dtype)


def pooled_rows(
    cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int, pooling_type: str
) -> tuple[jax.Array, jax.Array]:
    """(int32[S] the token row each sequence pools under a ONE_ROW type, bool[S] whether the
    sequence is there): so the runner can ask the model for those rows' states alone."""
    starts, ends = cu_q_lens[:-1], cu_q_lens[1:]
    present = (jnp.arange(starts.shape[0]) < num_seqs) & (ends > starts)
    index = starts if pooling_type == "CLS" else ends - 1
    return jnp.clip(index, 0, num_tokens - 1), present


def pool_rows(rows: jax.Array, present: jax.Array) -> jax.Array:
    """pool's output from the pooled rows' states [S, H] (pooled_rows'): padding ones zeroed."""
    return jnp.where(present[:, None], rows.astype(jnp.float32), 0.0).astype(rows.dtype)


def normalize(x: jax.Array) -> jax.Array:
    """L2-normalise the last axis (in f32), as torch.nn.functional.normalize: x / max(|x|, eps)."""
    xf = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True))
    return (xf / jnp.maximum(norm, NORMALIZE_EPS)).astype(x.dtype)
