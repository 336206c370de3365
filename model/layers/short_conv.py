"""Short causal depthwise conv1d over a ragged batch, continued from a per-sequence tail.

Kimi-Linear's KDA layers pass q, k and v through a width-W (4) depthwise causal convolution:
out[t] = sum_i w[c, i] * x[t - (W-1) + i] per channel c (HF's `F.conv1d(..., padding=W-1)` cut to
the sequence, as in `causal_conv1d_fn`). A sequence scheduled over several steps sees its earlier
inputs through its tail: the last W-1 inputs before this step's first token, kept in the request's
state slot (zeros for a sequence that starts here). Every row of the batch is handled the same way,
a decode row (one token) and a prefill chunk alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_rows(cu_q_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(row int32[T], offset int32[T]): each token's batch row and its index within the row's
    chunk. Padding tokens (past cu_q_lens[-1]) get the last row and an offset past its end."""
    rows = cu_q_lens.shape[0] - 1
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.searchsorted(cu_q_lens[1:], tok, side="right")
    row = jnp.minimum(row, rows - 1).astype(jnp.int32)
    return row, tok - cu_q_lens[row]


def short_conv(
    x: jax.Array,
    weight: jax.Array,
    tails: jax.Array,
    cu_q_lens: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """(out [T, C] in x's dtype, before any activation; new tails [S, W-1, C] in tails' dtype).

    x [T, C] this step's inputs, rows laid out by cu_q_lens int32[S + 1]; weight [W, C];
    tails [S, W-1, C] each row's last W-1 inputs before this step, oldest first. A row's new tail
    is the last W-1 inputs of (old tail, this step's inputs); an empty row keeps its tail.
    Products are summed in float32 and rounded once.
    """
    t, _ = x.shape
    w = weight.shape[0]
    if tails.shape[1:] != (w - 1, x.shape[1]) or tails.shape[0] != cu_q_lens.shape[0] - 1:
        raise ValueError(
            f"short_conv: tails must be [S={cu_q_lens.shape[0] - 1}, W-1={w - 1}, "
            f"C={x.shape[1]}], got {tails.shape}"
        )
    row, offset = token_rows(cu_q_lens, t)
    wf = weight.astype(jnp.float32)
    acc = x.astype(jnp.float32) * wf[w - 1]
    tok = jnp.arange(t, dtype=jnp.int32)
    for d in range(1, w):
        # The input d tokens back: this step's x while inside the chunk, else the row's tail.
        from_x = x[jnp.maximum(tok - d, 0)].astype(jnp.float32)
        from_tail = tails[row, jnp.clip(w - 1 + offset - d, 0, w - 2)].astype(jnp.float32)
        back = jnp.where((offset >= d)[:, None], from_x, from_tail)
        acc = acc + back * wf[w - 1 - d]
    return acc.astype(x.dtype), _new_tails(x, tails, cu_q_lens)


def _new_tails(x: jax.Array, tails: jax.Array, cu_q_lens: jax.Array) -> jax.Array:
    t = x.shape[0]
    keep = tails.shape[1]
    n = (cu_q_lens[1:] - cu_q_lens[:-1])[:, None]  # [S, 1]
    m = jnp.arange(keep, dtype=jnp.int32)[None, :]
    rel = n - keep + m  # index within this step's chunk; < 0: still in the old tail
    from_x = x[jnp.clip(cu_q_lens[:-1, None] + rel, 0, t - 1)].astype(tails.dtype)
    from_tail = jnp.take_along_axis(tails, jnp.clip(n + m, 0, keep - 1)[..., None], axis=1)
    return jnp.where((rel >= 0)[..., None], from_x, from_tail)
