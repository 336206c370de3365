"""KDA gate and beta activations: raw projections to the log-decay g (<= 0) and the write strength."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kda_gate(g_raw, a_log, dt_bias, *, lower_bound: float | None = None):
    """Per-channel log decay g [..., HV, K] in float32 from the gate projection g_raw [..., HV, K].

    `a_log` is [HV] and `dt_bias` is [HV * K] (or [HV, K]). Without `lower_bound` this is the default
    (Kimi-Linear) form -exp(A_log) * softplus(g_raw + dt_bias), unbounded below; with it, the bounded
    form lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias)) with lower_bound in [-5, 0].
    """
    hv, kd = g_raw.shape[-2:]
    if a_log.shape != (hv,):
        raise ValueError(f"kda_gate: A_log must be [HV={hv}], got {a_log.shape}")
    if dt_bias.size != hv * kd:
        raise ValueError(
            f"kda_gate: dt_bias must hold HV*K = {hv * kd} values, got {dt_bias.shape}"
        )
    x = g_raw.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(hv, kd)
    rate = jnp.exp(a_log.astype(jnp.float32))[:, None]
    if lower_bound is None:
        return -rate * jax.nn.softplus(x)
    if not -5.0 <= lower_bound <= 0.0:
        raise ValueError(f"kda_gate: lower_bound must lie in [-5, 0], got {lower_bound}")
    return lower_bound * jax.nn.sigmoid(rate * x)


def kda_beta(b):
    """beta = sigmoid(b) in float32, from the b projection [..., HV]."""
    return jax.nn.sigmoid(b.astype(jnp.float32))
