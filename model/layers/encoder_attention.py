"""Self-attention within each sequence of a ragged batch of whole prompts, with no KV cache:
encoders (bidirectional) and any model whose every sequence is computed in one step.

Three ways, by the dense-attention implementation chosen once when the model is built
(`choose_backend`):

- A kernel (pallas_kernels.flash_attention on a GPU): the flat token axis is gathered into one
  padded row per sequence, [S, L] with L a static bound on every sequence's length (the caller's:
  the model's max_model_len or what the batch's block tables can hold), padding marked by segment
  ids; the result is gathered back onto the flat axis.
- On the CPU, where the C++ kernels build: the paged prefill kernel reading the step's keys and
  values in place (`native_attention`), in f32 whatever the model's dtype, as the loop computes.
- The jnp reference (the CPU otherwise): a loop over the batch's real sequences, each attending
  within a window of L tokens of the flat axis. The padded layout computes S_pad x L^2 scores,
  most of them for padding: a step of 9 prompts of ~215 tokens is bucketed to 16 rows of 256, and
  the reference's masking passes over that tensor cost 3.7x the loop on a 2-core CPU (12 heads of
  32, best of 4, loaded). The loop computes num_seqs x L^2 and reads no padded copy of q, k, v.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.backends import Choice
from pallas_kernels.flash_attention import flash_attention, select
from pallas_kernels.ragged_paged_attention import native


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
    num_seqs: jax.Array,
    *,
    max_len: int,
    causal: bool,
    sm_scale: float,
    backend: Choice,
) -> jax.Array:
    """q [T, H, D], k and v [T, Hkv, D] over whole sequences laid out by cu_q_lens [S + 1], the
    first `num_seqs` of them real -> [T, H, D].

    Every sequence must be at most `max_len` tokens (static; a longer one would be cut). Tokens
    after the last sequence (batch padding) get finite values that no caller reads.
    """
    max_len = min(max_len, q.shape[0])
    wide = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    if backend.impl == "reference" and native.serves("prefill", wide, wide):
        return native_attention(
            q, k, v, cu_q_lens, num_seqs, max_len=max_len, causal=causal, sm_scale=sm_scale
        )
    if backend.impl == "reference":
        return sequence_loop_attention(
            q, k, v, cu_q_lens, num_seqs, max_len=max_len, causal=causal, sm_scale=sm_scale
        )
    return _padded_attention(
        q, k, v, cu_q_lens, max_len=max_len, causal=causal, sm_scale=sm_scale, backend=backend
    )


def native_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    max_len: int,
    causal: bool,
    sm_scale: float,
) -> jax.Array:
    """The C++ prefill kernel (ragged_paged_attention/native.py) reading this step's keys and
    values in place: the token axis is a paged cache of one token per page, each sequence's
    table its own tokens; bidirectional as a prefix LM whose prefix is the whole sequence. In f32
    for every dtype, the result cast back: the loop (the semantics here) computes in f32, and a
    bf16 query given to the kernel as it is would round its probabilities as HF's causal flash
    kernel does, which the loop does not. A bf16 or f16 encoder on the CPU took the loop before,
    1.5x slower (MiniLM under auto, float16: 600 sentences 12.9 s)."""
    dtype = q.dtype
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    num_tokens = q.shape[0]
    lens = cu_q_lens[1:] - cu_q_lens[:-1]
    tables = jnp.minimum(cu_q_lens[:-1, None] + jnp.arange(max_len)[None, :], num_tokens - 1)
    return native.prefill(
        q,
        k[:, None],
        v[:, None],
        lens,
        tables,
        cu_q_lens,
        num_seqs,
        prefix_lens=None if causal else lens,
        sm_scale=sm_scale,
    ).astype(dtype)


def sequence_loop_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    max_len: int,
    causal: bool,
    sm_scale: float,
) -> jax.Array:
    """Attention one real sequence at a time (a loop of num_seqs iterations, a traced count):
    sequence i reads the window of `max_len` tokens from its start and writes its output back
    there. A window reaches past its sequence into the next one's rows (masked as keys, and
    overwritten when the loop reaches that sequence, since starts only grow) or into rows appended
    after the batch, so no slice is ever moved back by XLA's clamping."""
    num_tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads

    def extended(x):
        return jnp.concatenate([x, jnp.zeros((max_len, *x.shape[1:]), x.dtype)])

    # Scaled once over [T, H, D] rather than per window over [H, L, L].
    q_all = extended(q.astype(jnp.float32) * sm_scale)
    k_all, v_all = extended(k), extended(v)
    offsets = jnp.arange(max_len)
    allowed = offsets[None, :] <= offsets[:, None] if causal else True  # [L, L] or every key

    def one_sequence(i, out):
        start, length = cu_q_lens[i], cu_q_lens[i + 1] - cu_q_lens[i]

        def window(x, shape):
            # Head-major [Hkv, G, L, D] (or [Hkv, 1, L, D]): batched matmuls with no transposes
            # of the [L, L] scores (30% less time than the token-major einsums, loaded CPU).
            rows = lax.dynamic_slice_in_dim(x, start, max_len).astype(jnp.float32)
            return rows.reshape(max_len, *shape).transpose(1, 2, 0, 3)

        inside = offsets < length
        qs = window(q_all, (kv_heads, groups, dim))
        ks = window(k_all, (kv_heads, 1, dim))
        # Keys past the sequence are the next one's (or zeros): masked, and their values zeroed
        # so that a non-finite value there cannot reach this sequence through 0 * inf.
        vs = jnp.where(inside[:, None], window(v_all, (kv_heads, 1, dim)), 0.0)
        scores = qs @ ks.swapaxes(-1, -2)  # [Hkv, G, L, L]
        # Every query row keeps key 0 (a sequence has at least one token), so no row is empty.
        weights = jax.nn.softmax(jnp.where(inside[None, :] & allowed, scores, -jnp.inf), axis=-1)
        attended = (weights @ vs).transpose(2, 0, 1, 3).reshape(max_len, heads, dim)
        return lax.dynamic_update_slice_in_dim(out, attended.astype(out.dtype), start, 0)

    out = lax.fori_loop(0, num_seqs, one_sequence, jnp.zeros((len(q_all), heads, dim), q.dtype))
    return out[:num_tokens]


def _padded_attention(q, k, v, cu_q_lens, *, max_len, causal, sm_scale, backend) -> jax.Array:
    """One padded row per sequence through the dense-attention kernel, gathered back."""
    num_tokens = q.shape[0]
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
