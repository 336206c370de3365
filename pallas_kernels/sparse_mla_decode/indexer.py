"""Lightning indexer top-k (DeepSeek V3.2 DSA, kernels.md B.2), un-quantised, in plain jnp.

score[t, s] = sum_h weights[t, h] * relu(q_idx[t, h] . k_idx[s]) over the allowed rows s <
causal_limits[t]; the ids of the top-k scores are returned, ties broken towards the lower id, and
padded with -1 where fewer than topk rows are allowed. This is the path HF's `deepseek_v32` takes
(no Hadamard rotation, no FP8), so a model can be checked against HF; any positive scale HF applies
inside the ReLU (softmax_scale) or to the weights must be folded into `weights` by the caller.
Unlike HF, which lets masked rows fill a short top-k, those entries are -1 here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check(q_idx, k_idx, weights, topk, causal_limits):
    if q_idx.ndim != 3:
        raise ValueError(f"q_idx must be [T, H_idx, D_idx], got shape {q_idx.shape}")
    T, H, D = q_idx.shape
    if k_idx.ndim != 2 or k_idx.shape[1] != D or k_idx.shape[0] < 1:
        raise ValueError(f"k_idx must be [S>=1, D_idx={D}], got shape {k_idx.shape}")
    if weights.shape != (T, H):
        raise ValueError(f"weights must be [T={T}, H_idx={H}], got shape {weights.shape}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if causal_limits.shape != (T,) or not jnp.issubdtype(causal_limits.dtype, jnp.integer):
        raise ValueError(
            f"causal_limits must be int[{T}], got {causal_limits.dtype}{list(causal_limits.shape)}"
        )


def index_scores(q_idx, k_idx, weights):
    """f32[T, S]: sum_h w[t, h] * relu(q[t, h] . k[s]), one head at a time so memory stays T x S."""
    k = k_idx.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST

    def head(acc, qw):
        q_h, w_h = qw
        s = jnp.dot(q_h.astype(jnp.float32), k.T, precision=hi)
        return acc + w_h.astype(jnp.float32)[:, None] * jax.nn.relu(s), None

    acc = jnp.zeros((q_idx.shape[0], k_idx.shape[0]), jnp.float32)
    acc, _ = jax.lax.scan(head, acc, (jnp.swapaxes(q_idx, 0, 1), weights.T))
    return acc


def indexer_topk(q_idx, k_idx, weights, topk, causal_limits):
    """int32[T, topk]: the row ids of k_idx with the highest index scores, -1 padded."""
    _check(q_idx, k_idx, weights, topk, causal_limits)
    S = k_idx.shape[0]
    limits = causal_limits.astype(jnp.int32)[:, None]
    allowed = jnp.arange(S, dtype=jnp.int32)[None, :] < limits
    scores = jnp.where(allowed, index_scores(q_idx, k_idx, weights), -jnp.inf)
    _, ids = jax.lax.top_k(scores, min(topk, S))
    # Disallowed rows only surface once the allowed ones run out; allowed means id < limit.
    ids = jnp.where(ids < limits, ids, -1).astype(jnp.int32)
    return jnp.pad(ids, ((0, 0), (0, topk - ids.shape[1])), constant_values=-1)
