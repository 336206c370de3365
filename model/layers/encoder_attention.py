"""Self-attention within each sequence of a ragged batch of whole prompts, with no KV cache:
encoders (bidirectional) and any model whose every sequence is computed in one step.

The flat token axis is gathered into one padded row per sequence, [S, L] with L a static bound on
every sequence's length (the caller's: the model's max_model_len or what the batch's block tables
can hold), so the dense attention op (pallas_kernels.flash_attention) sees each
sequence alone, padding marked by segment ids; the result is gathered back onto the flat axis.
The kernel is chosen once, when the model is built (`choose_backend`), and the dispatcher only
confirms it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.backends import Choice
from pallas_kernels.flash_attention import flash_attention, select


def choose_backend(*, num_heads: int, head_dim: int, dtype, causal: bool, impl: str) -> Choice:
    """The dense-attention implementation for layers of these shapes (one decision, logged)."""
    q = jax.ShapeDtypeStruct((1, 1, num_heads, head_dim), dtype)
    segments = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return select(q, q, causal=causal, segment_ids=segments, impl=impl)


def ragged_self_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_q_lens: jax.Array,
    *,
    max_len: int,
    causal: bool,
    sm_scale: float,
    backend: Choice,
) -> jax.Array:
    """q [T, H, D], k and v [T, Hkv, D] over whole sequences laid out by cu_q_lens [S + 1]
    -> [T, H, D].

    Every sequence must be at most `max_len` tokens (static; a longer one would be cut). Tokens
    after the last sequence (batch padding) get finite values that no caller reads.
    """
    num_tokens = q.shape[0]
    max_len = min(max_len, num_tokens)
    starts, ends = cu_q_lens[:-1], cu_q_lens[1:]
    offsets = jnp.arange(max_len)
    valid = offsets[None, :] < (ends - starts)[:, None]  # [S, L]
    rows = jnp.where(valid, starts[:, None] + offsets[None, :], 0)

    def padded(x):
        return x[rows]  # [S, L, heads, D]

    # Segment 1: the sequence's tokens; 0: padding, which attends only to padding.
    out = flash_attention(
        padded(q),
        padded(k),
        padded(v),
        causal=causal,
        sm_scale=sm_scale,
        segment_ids=valid.astype(jnp.int32),
        impl=backend,
    )
    token = jnp.arange(num_tokens)
    seq = jnp.minimum(jnp.searchsorted(ends, token, side="right"), starts.shape[0] - 1)
    offset = jnp.clip(token - starts[seq], 0, max_len - 1)
    return out[seq, offset]
