"""Shape checks shared by every KDA implementation, so bad input fails the same way on each path."""

from __future__ import annotations

import jax.numpy as jnp


def _fail(op: str, what: str) -> None:
    raise ValueError(f"{op}: {what}")


def check_common(op: str, q, k, v, g, beta) -> tuple[int, int, int, int, int]:
    """(T, H, K, HV, V) of q/k [T, H, K], v [T, HV, V], g [T, HV, K], beta [T, HV]."""
    if q.ndim != 3 or k.shape != q.shape:
        _fail(op, f"q {q.shape} and k {k.shape} must both be [T, H, K]")
    t, h, kd = q.shape
    if v.ndim != 3 or v.shape[0] != t:
        _fail(op, f"v must be [T={t}, HV, V], got {v.shape}")
    hv, vd = v.shape[1:]
    if hv % h:
        _fail(op, f"value heads HV={hv} must be a multiple of q/k heads H={h}")
    if g.shape != (t, hv, kd):
        _fail(op, f"g must be [T, HV, K] = {(t, hv, kd)}, got {g.shape}")
    if beta.shape != (t, hv):
        _fail(op, f"beta must be [T, HV] = {(t, hv)}, got {beta.shape}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            _fail(op, f"{name} must be a float array, got dtype {x.dtype}")
    return t, h, kd, hv, vd


def check_prefill(op: str, q, k, v, g, beta, cu_seqlens, initial_state) -> int:
    """Number of sequences N; `initial_state` may be None (zero states)."""
    _, _, kd, hv, vd = check_common(op, q, k, v, g, beta)
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.dtype != jnp.int32:
        _fail(
            op, f"cu_seqlens must be int32[N + 1], got {cu_seqlens.dtype}{list(cu_seqlens.shape)}"
        )
    n = cu_seqlens.shape[0] - 1
    if initial_state is not None and initial_state.shape != (n, hv, vd, kd):
        _fail(
            op,
            f"initial_state must be [N, HV, V, K] = {(n, hv, vd, kd)}, got {initial_state.shape}",
        )
    return n


def check_decode(op: str, q, k, v, g, beta, state_pool, state_indices) -> int:
    """Number of decode rows N; the pool is [P, HV, V, K] and indices int32[N] (-1 = padding)."""
    n, _, kd, hv, vd = check_common(op, q, k, v, g, beta)
    if state_pool.ndim != 4 or state_pool.shape[1:] != (hv, vd, kd):
        _fail(
            op, f"state_pool must be [P, HV, V, K] = [P, {hv}, {vd}, {kd}], got {state_pool.shape}"
        )
    if state_indices.shape != (n,) or state_indices.dtype != jnp.int32:
        _fail(
            op,
            f"state_indices must be int32[{n}], got {state_indices.dtype}{list(state_indices.shape)}",
        )
    return n
