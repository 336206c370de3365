"""Sparse MLA decode in plain jnp: the oracle for the Pallas kernel, and the spec of the op.

One query token per row attends to `topk` cache slots picked by an indexer (DeepSeek V3.2 DSA, and
DeepSeek V4 with a second "extra" pool of compressed slots). MLA keys and values share the latent:
the key is a whole cache row [D_qk = d_v + rope], the value is its first `d_v` channels.

Semantics (FlashMLA's sparse decode, kernels.md B.4):
- an index entry is valid when it is in [0, num_slots) and its position is below that row's
  `topk_lengths`; -1 (or any out-of-range id) is invalid; duplicate ids count once per entry;
- main and extra entries share one softmax; the sink adds exp(sink[h]) to its denominator only;
- `lse` is the natural log of the sink-free denominator; a row with no valid entry gives out = 0 and
  lse = +inf;
- `nan_free=False` scrubs the rows of invalid entries, so NaN or garbage in unselected cache rows can
  never reach the output; `nan_free=True` lets an implementation skip that scrub and is only correct
  when every row it may read is finite (a pool vlax wrote itself; never bytes from a KV store).
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

DTYPES = frozenset({"bfloat16", "float32"})


def _check_pool(name, cache, idx, lengths, T, D):
    if cache.ndim != 2 or cache.shape[1] != D:
        raise ValueError(f"{name} cache must be [num_slots, {D}], got shape {cache.shape}")
    if cache.shape[0] < 1:
        raise ValueError(f"{name} cache must have at least one slot, got shape {cache.shape}")
    if idx.ndim != 2 or idx.shape[0] != T or idx.shape[1] < 1:
        raise ValueError(f"{name} indices must be [T={T}, topk>=1], got shape {idx.shape}")
    if idx.dtype != jnp.int32:
        raise ValueError(f"{name} indices must be int32, got {idx.dtype}")
    if lengths is not None and (lengths.shape != (T,) or lengths.dtype != jnp.int32):
        raise ValueError(
            f"{name} topk_lengths must be int32[{T}], got {lengths.dtype}{list(lengths.shape)}"
        )


def check_args(
    q,
    kv_cache,
    indices,
    *,
    sm_scale,
    d_v,
    topk_lengths,
    sink,
    extra_kv_cache,
    extra_indices,
    extra_topk_lengths,
) -> None:
    """Raise ValueError naming the bad argument; shared by every implementation."""
    if q.ndim != 3 or min(q.shape) < 1:
        raise ValueError(f"q must be [T>=1, H>=1, D_qk>=1], got shape {q.shape}")
    T, H, D = q.shape
    if jnp.dtype(q.dtype).name not in DTYPES:
        raise ValueError(f"q dtype must be one of {sorted(DTYPES)}, got {q.dtype}")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must equal q dtype {q.dtype}")
    if not isinstance(d_v, int) or not 0 < d_v <= D:
        raise ValueError(f"d_v must be an int in [1, D_qk={D}], got {d_v!r}")
    if not isinstance(sm_scale, numbers.Real) or not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite Python number, got {sm_scale!r}")
    _check_pool("main", kv_cache, indices, topk_lengths, T, D)
    if (extra_kv_cache is None) != (extra_indices is None):
        raise ValueError("extra_kv_cache and extra_indices must be given together")
    if extra_kv_cache is None and extra_topk_lengths is not None:
        raise ValueError("extra_topk_lengths given without an extra pool")
    if extra_kv_cache is not None:
        if extra_kv_cache.dtype != q.dtype:
            raise ValueError(f"extra_kv_cache dtype {extra_kv_cache.dtype} must equal {q.dtype}")
        _check_pool("extra", extra_kv_cache, extra_indices, extra_topk_lengths, T, D)
    if sink is not None and (sink.shape != (H,) or not jnp.issubdtype(sink.dtype, jnp.floating)):
        raise ValueError(
            f"sink must be a float array of shape ({H},), got {sink.dtype}{sink.shape}"
        )


def valid_mask(indices, topk_lengths, num_slots):
    """bool[T, topk]: which entries are attended."""
    pos = jnp.arange(indices.shape[1], dtype=jnp.int32)[None, :]
    ok = (indices >= 0) & (indices < num_slots)
    if topk_lengths is not None:
        ok &= pos < topk_lengths[:, None]
    return ok


def _gather(cache, indices, valid, nan_free):
    rows = cache[jnp.where(valid, indices, 0)].astype(jnp.float32)  # [T, K, D]
    if nan_free:
        return rows
    return jnp.where(valid[..., None], rows, 0.0)


def sparse_mla_decode(
    q,
    kv_cache,
    indices,
    *,
    sm_scale,
    d_v,
    topk_lengths=None,
    sink=None,
    extra_kv_cache=None,
    extra_indices=None,
    extra_topk_lengths=None,
    nan_free=False,
):
    """Returns (out [T, H, d_v] in q's dtype, lse f32[T, H] natural log, sink-free)."""
    check_args(
        q,
        kv_cache,
        indices,
        sm_scale=sm_scale,
        d_v=d_v,
        topk_lengths=topk_lengths,
        sink=sink,
        extra_kv_cache=extra_kv_cache,
        extra_indices=extra_indices,
        extra_topk_lengths=extra_topk_lengths,
    )
    valid = valid_mask(indices, topk_lengths, kv_cache.shape[0])
    rows = _gather(kv_cache, indices, valid, nan_free)
    if extra_kv_cache is not None:
        e_valid = valid_mask(extra_indices, extra_topk_lengths, extra_kv_cache.shape[0])
        rows = jnp.concatenate([rows, _gather(extra_kv_cache, extra_indices, e_valid, nan_free)], 1)
        valid = jnp.concatenate([valid, e_valid], axis=1)

    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("thd,tkd->thk", q.astype(jnp.float32), rows, precision=hi) * sm_scale
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    denom = jnp.sum(p, axis=-1)
    acc = jnp.einsum("thk,tkd->thd", p, rows[..., :d_v], precision=hi)
    has_any = denom > 0
    lse = jnp.where(has_any, m_safe + jnp.log(jnp.where(has_any, denom, 1.0)), jnp.inf)
    if sink is not None:
        denom = denom + jnp.exp(sink.astype(jnp.float32)[None, :] - m_safe)
    out = jnp.where(has_any[..., None], acc / jnp.where(has_any, denom, 1.0)[..., None], 0.0)
    return out.astype(q.dtype), lse
