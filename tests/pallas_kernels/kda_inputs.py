"""Random KDA inputs shared by the KDA kernel tests (fresh values, never zeros)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda import kda_beta, kda_gate


def gates(rng, t, hv, kd, *, form: str):
    """g [T, HV, K] from the real activations: 'default' (down to about -20 per step), 'bounded'
    (lower bound -5), or 'near0' (the default form with tiny rates, g close to 0)."""
    raw = rng.normal(0.0, 2.0, (t, hv, kd)).astype(np.float32)
    bias = rng.normal(0.0, 1.0, (hv * kd,)).astype(np.float32)
    if form == "default":
        a_log = np.log(rng.uniform(0.5, 2.0, hv)).astype(np.float32)
        g = kda_gate(jnp.asarray(raw), jnp.asarray(a_log), jnp.asarray(bias))
        return jnp.maximum(g, -20.0)
    if form == "bounded":
        a_log = rng.normal(0.0, 1.0, hv).astype(np.float32)
        return kda_gate(jnp.asarray(raw), jnp.asarray(a_log), jnp.asarray(bias), lower_bound=-5.0)
    if form == "near0":
        a_log = np.full(hv, -8.0, np.float32)
        return kda_gate(jnp.asarray(raw), jnp.asarray(a_log), jnp.asarray(bias))
    raise ValueError(f"unknown gate form {form!r}")


def prefill_inputs(rng, lens, t, h, hv, kd, vd, *, dtype, form="default", init=True, pad_nan=True):
    """(q, k, v, g, beta, cu_seqlens, initial_state); tokens past sum(lens) up to t are NaN."""
    used = int(sum(lens))
    assert t >= used

    def arr(shape, scale=1.0):
        x = rng.normal(0.0, scale, shape).astype(np.float32)
        if pad_nan:
            x[used:] = np.nan
        return jnp.asarray(x, dtype)

    g = np.array(gates(rng, t, hv, kd, form=form))
    beta = np.array(kda_beta(jnp.asarray(rng.normal(0.0, 1.5, (t, hv)), jnp.float32)))
    if pad_nan:
        g[used:] = np.nan
        beta[used:] = np.nan
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    n = len(lens)
    s0 = (
        jnp.asarray(rng.normal(0.0, 1.0, (n, hv, vd, kd)), jnp.float32)
        if init
        else jnp.zeros((n, hv, vd, kd), jnp.float32)
    )
    return (
        arr((t, h, kd)),
        arr((t, h, kd)),
        arr((t, hv, vd)),
        jnp.asarray(g, jnp.float32),
        jnp.asarray(beta, dtype),
        cu,
        s0,
    )
