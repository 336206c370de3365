"""Plain-jnp dense attention: the oracle for the flash kernel and the default path on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _precision():
    """f32 dots on GPUs default to TF32, too coarse for an oracle; the CPU's default is full f32
    and its HIGHEST path measured 2.5x slower on a batched decode einsum."""
    return None if jax.default_backend() == "cpu" else jax.lax.Precision.HIGHEST


def flash_attention(q, k, v, *, causal: bool, sm_scale: float, segment_ids=None):
    """q [B, S, H, D], k, v [B, S, Hkv, D] (H % Hkv == 0) -> [B, S, H, D] in q's dtype.

    With `segment_ids` int32[B, S], a token attends only to tokens of its own segment; every token
    sees at least itself, so no row is empty. A key a token does not attend (another segment, a
    later position under `causal`) never changes its output, whatever its K/V hold; a token that
    attends a value row holding NaN or inf gets NaN (pallas_kernels/masked_values.py).
    """
    b, s, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    qg = q.reshape(b, s, hkv, g, d).astype(jnp.float32)
    sc = jnp.einsum("bqkgd,bskd->bkgqs", qg, k.astype(jnp.float32), precision=_precision())
    sc = sc * sm_scale
    mask = jnp.ones((1, s, s), bool)
    if causal:
        mask = mask & jnp.tril(jnp.ones((s, s), bool))[None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    mask = mask[:, None, None]
    sc = jnp.where(mask, sc, -jnp.inf)
    m = jnp.max(sc, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(sc - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(den > 0, den, 1.0)
    # p is 0 for a masked key but 0 * NaN is not: non-finite value rows enter the product as
    # zeros, and the rows that attend one are set to NaN afterwards.
    v = v.astype(jnp.float32)
    v_bad = ~jnp.all(jnp.isfinite(v), axis=-1)  # [B, S, Hkv]
    v = jnp.where(v_bad[..., None], 0.0, v)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p, v, precision=_precision())
    attends_bad = jnp.any(mask & v_bad.transpose(0, 2, 1)[:, :, None, None, :], axis=-1)
    o = jnp.where(attends_bad.transpose(0, 3, 1, 2)[..., None], jnp.nan, o)  # [B, S, Hkv, 1, 1]
    return o.reshape(b, s, h, d).astype(q.dtype)
