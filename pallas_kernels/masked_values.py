"""Masked keys must not reach an attention output through their values.

A masked key's probability is an exact 0, but the value product is a dot, and 0 * NaN = NaN
(0 * inf too): a NaN in another segment's V, a padding token, a stale page or a later position
under the causal mask would poison every row of the tile. So the dot only ever sees finite
values: a value row holding NaN or inf enters it as zeros, and a query row that *attends* such a
key is set to NaN afterwards, as the plain sum would make it. Which rows attend is decided by the
same mask as the scores, so the rule is: a key a row does not attend never changes that row.
(KDA's chunked prefill has the same hazard in its lower-triangular products and applies the same
rule per token: kda/kernel.py.)

These act on one kernel tile (rows x keys); the jnp references apply the same rule with their own
batched shapes.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["finite_values", "nonfinite", "poison_rows"]


def nonfinite(x):
    """f32 flags like x: 1.0 where x is NaN or +-inf. Flags are floats, and are combined with
    max and cumsum, because those lower everywhere (a boolean `any` may not)."""
    # |x| < inf is False for NaN and +-inf
    return jnp.where(jnp.abs(x) < jnp.inf, 0.0, 1.0)


def finite_values(v):
    """v [keys, D] -> (v with its non-finite rows zeroed, f32[keys]: 1.0 where a row was)."""
    bad = jnp.max(nonfinite(v), axis=1)
    return jnp.where(bad[:, None] > 0, jnp.zeros_like(v), v), bad


def poison_rows(pv, mask, bad):
    """pv [rows, D] with NaN in every row that attends (mask [rows, keys]) a key whose value
    row was not finite (bad, from finite_values)."""
    hit = jnp.max(jnp.where(mask, bad[None, :], 0.0), axis=1) > 0
    return jnp.where(hit[:, None], jnp.nan, pv)
