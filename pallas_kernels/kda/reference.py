"""Plain-jnp oracles for Kimi Delta Attention (kernels.md A.1-A.2), all state math in float32.

Layout: flattened varlen tokens; q, k [T, H, K]; v [T, HV, V]; g [T, HV, K] (log decay per key
channel, <= 0); beta [T, HV]; cu_seqlens int32[N + 1]; states [N, HV, V, K] (V-first). Value head hv
reads q/k head hv // (HV // H). Tokens outside [cu_seqlens[0], cu_seqlens[N]) get a zero output.

`kda_recurrent_reference` is the spec (one token at a time); `kda_chunk_reference` is the chunked
WY/UT algorithm, kept separate so the chunk algebra is checked independently of any kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kda import shapes

HI = lax.Precision.HIGHEST


def l2norm(x):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _prepare_qk(q, k, hv, *, scale, l2norm_qk):
    """f32 q (scaled) and k, repeated to the HV value heads."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if l2norm_qk:
        q, k = l2norm(q), l2norm(k)
    rep = hv // q.shape[1]
    return jnp.repeat(q * scale, rep, axis=1), jnp.repeat(k, rep, axis=1)


def _zero_states(initial_state, n, hv, vd, kd):
    if initial_state is None:
        return jnp.zeros((n, hv, vd, kd), jnp.float32)
    return initial_state.astype(jnp.float32)


def recurrent_step(s, q, k, v, g, beta):
    """One token for every head: s [HV, V, K], q/k/g [HV, K] (q already scaled), v [HV, V], beta [HV]."""
    s = s * jnp.exp(g)[:, None, :]
    u = v - jnp.einsum("hvk,hk->hv", s, k, precision=HI)
    s = s + beta[:, None, None] * u[:, :, None] * k[:, None, :]
    return s, jnp.einsum("hvk,hk->hv", s, q, precision=HI)


def kda_recurrent_reference(
    q, k, v, g, beta, cu_seqlens, initial_state=None, *, scale: float, l2norm_qk: bool = True
):
    """(o [T, HV, V] in v's dtype, final_state [N, HV, V, K] float32), one token at a time."""
    n = shapes.check_prefill("kda_recurrent_reference", q, k, v, g, beta, cu_seqlens, initial_state)
    t, _, kd = q.shape
    hv, vd = v.shape[1:]
    qf, kf = _prepare_qk(q, k, hv, scale=scale, l2norm_qk=l2norm_qk)
    s0 = _zero_states(initial_state, n, hv, vd, kd)
    tok = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_seqlens, tok, side="right") - 1, 0, max(n - 1, 0))
    live = (tok >= cu_seqlens[0]) & (tok < cu_seqlens[n])
    first = live & (tok == cu_seqlens[seq])

    def step(carry, x):
        s, finals = carry
        qt, kt, vt, gt, bt, i, is_first, is_live = x
        s = jnp.where(is_first, finals[i], s)
        s_new, o = recurrent_step(s, qt, kt, vt, gt, bt)
        s = jnp.where(is_live, s_new, s)
        finals = finals.at[i].set(jnp.where(is_live, s, finals[i]))
        return (s, finals), jnp.where(is_live, o, 0.0)

    xs = (qf, kf, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32))
    init = (jnp.zeros((hv, vd, kd), jnp.float32), s0)
    (_, finals), o = lax.scan(step, init, (*xs, seq, first, live))
    return o.astype(v.dtype), finals


def _chunk_work(cu_seqlens, t, c):
    """Per chunk slot m: (sequence, first token, live tokens, starts a sequence); M = T // C + N."""
    n = cu_seqlens.shape[0] - 1
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    offs = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum((lens + c - 1) // c)])
    m = jnp.arange(t // c + n, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(offs, m, side="right") - 1, 0, n - 1)
    live = m < offs[n]
    start = cu_seqlens[seq] + (m - offs[seq]) * c
    count = jnp.where(live, jnp.minimum(c, cu_seqlens[seq + 1] - start), 0)
    return seq, start, count, live & (m == offs[seq])


def chunk_step(s, q, k, v, g, beta):
    """One chunk for every head by the WY/UT form; every exponent is a difference G_i - G_j <= 0.

    s [HV, V, K]; q (scaled), k, g [C, HV, K]; v [C, HV, V]; beta [C, HV]. Rows past the chunk's end
    must be zero in k, v, g and beta.

    The products give a later token an exact 0 weight in earlier rows, but 0 * NaN is NaN: a
    token whose k, g or beta is not finite enters as zeros and makes every output from it on
    NaN, a non-finite value its own column from it on, as the recurrence does
    (pallas_kernels/masked_values.py).
    """
    bad = ~(jnp.isfinite(k).all(-1) & jnp.isfinite(g).all(-1) & jnp.isfinite(beta))  # [C, HV]
    k, g = (jnp.where(bad[..., None], 0.0, x) for x in (k, g))
    beta = jnp.where(bad, 0.0, beta)
    v_bad = ~jnp.isfinite(v)
    v = jnp.where(v_bad, 0.0, v)
    s, o = _chunk_products(s, q, k, v, g, beta)
    since_bad = (jnp.cumsum(bad, axis=0) > 0)[..., None] | (jnp.cumsum(v_bad, axis=0) > 0)
    s_bad = bad.any(axis=0)[:, None] | v_bad.any(axis=0)  # [HV, V]
    return jnp.where(s_bad[..., None], jnp.nan, s), jnp.where(since_bad, jnp.nan, o)


def _chunk_products(s, q, k, v, g, beta):
    """chunk_step on finite inputs."""
    c = q.shape[0]
    cum = jnp.cumsum(g, axis=0)
    diff = cum[:, None] - cum[None, :]  # [i, j, HV, K]
    i, j = jnp.arange(c)[:, None], jnp.arange(c)[None, :]
    lower = (j <= i)[:, :, None, None]
    decay = jnp.exp(jnp.where(lower, diff, -jnp.inf))
    # k_j decayed to row i, shared by both products; summed over K as elementwise products
    # (a three-operand einsum transposed the [C, C, HV, K] tensor first on XLA:CPU).
    k_decayed = k[None, :] * decay
    a = jnp.sum(k[:, None] * k_decayed, axis=-1).transpose(2, 0, 1)  # [HV, i, j]
    a = jnp.where(j < i, a * beta.T[:, :, None], 0.0)
    aqk = jnp.sum(q[:, None] * k_decayed, axis=-1).transpose(2, 0, 1)
    eye = jnp.broadcast_to(jnp.eye(c, dtype=jnp.float32), a.shape)
    tinv = jax.scipy.linalg.solve_triangular(eye + a, eye, lower=True, unit_diagonal=True)
    bt = beta[:, :, None]
    w = jnp.einsum("hij,jhd->hid", tinv, bt * jnp.exp(cum) * k, precision=HI)
    u = jnp.einsum("hij,jhv->hiv", tinv, bt * v, precision=HI)
    vp = u - jnp.einsum("hik,hvk->hiv", w, s, precision=HI)
    o = jnp.einsum("ihk,hvk->ihv", q * jnp.exp(cum), s, precision=HI)
    o = o + jnp.einsum("hij,hjv->ihv", aqk, vp, precision=HI)
    last = cum[c - 1]
    s = s * jnp.exp(last)[:, None, :]
    s = s + jnp.einsum("hiv,ihk->hvk", vp, jnp.exp(last[None] - cum) * k, precision=HI)
    return s, o


def kda_chunk_reference(
    q,
    k,
    v,
    g,
    beta,
    cu_seqlens,
    initial_state=None,
    *,
    scale: float,
    l2norm_qk: bool = True,
    chunk_size: int = 64,
):
    """Same contract as `kda_recurrent_reference`, computed chunk by chunk (any chunk_size >= 1)."""
    n = shapes.check_prefill("kda_chunk_reference", q, k, v, g, beta, cu_seqlens, initial_state)
    if chunk_size < 1:
        raise ValueError(f"kda_chunk_reference: chunk_size must be >= 1, got {chunk_size}")
    t, _, kd = q.shape
    hv, vd = v.shape[1:]
    c = chunk_size
    s0 = _zero_states(initial_state, n, hv, vd, kd)
    if t == 0 or n == 0:
        return jnp.zeros((t, hv, vd), v.dtype), s0
    qf, kf = _prepare_qk(q, k, hv, scale=scale, l2norm_qk=l2norm_qk)
    xs = (qf, kf, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32))
    seq, start, count, first = _chunk_work(cu_seqlens, t, c)
    rows = jnp.arange(c, dtype=jnp.int32)

    def step(carry, w):
        s, finals = carry
        i, t0, cnt, is_first = w
        idx = jnp.minimum(t0 + rows, t - 1)
        keep = rows < cnt
        qc, kc, vc, gc, bc = (
            jnp.where(keep.reshape((c,) + (1,) * (x.ndim - 1)), x[idx], 0.0) for x in xs
        )
        s = jnp.where(is_first, finals[i], s)
        s_new, o = chunk_step(s, qc, kc, vc, gc, bc)
        s = jnp.where(cnt > 0, s_new, s)
        finals = finals.at[i].set(jnp.where(cnt > 0, s, finals[i]))
        return (s, finals), (jnp.where(keep, t0 + rows, t), o)

    init = (jnp.zeros((hv, vd, kd), jnp.float32), s0)
    (_, finals), (where, o) = lax.scan(step, init, (seq, start, count, first))
    out = (
        jnp.zeros((t, hv, vd), jnp.float32)
        .at[where.reshape(-1)]
        .set(o.reshape(-1, hv, vd), mode="drop")
    )
    return out.astype(v.dtype), finals


def kda_decode_reference(
    q, k, v, g, beta, state_pool, state_indices, *, scale: float, l2norm_qk: bool = True
):
    """One token per row; (o [N, HV, V], new pool). Rows with slot -1 output zeros and touch nothing.

    Row by row, each reading and writing its own slot of the pool in place: on XLA:CPU the batched
    form (gather every row's state, step, scatter back) streams N states through memory several
    times and fell off a cliff past the cache (N 64, 4 heads of 128: 56 ms against 6 ms this way,
    same bits).
    """
    shapes.check_decode("kda_decode_reference", q, k, v, g, beta, state_pool, state_indices)
    hv = v.shape[1]
    qf, kf = _prepare_qk(q, k, hv, scale=scale, l2norm_qk=l2norm_qk)
    vf, gf, bf = (x.astype(jnp.float32) for x in (v, g, beta))

    def row(r, carry):
        pool, out = carry
        live = state_indices[r] >= 0
        slot = jnp.where(live, state_indices[r], 0)
        old = lax.dynamic_index_in_dim(pool, slot, keepdims=False)
        s, o = recurrent_step(old.astype(jnp.float32), qf[r], kf[r], vf[r], gf[r], bf[r])
        pool = lax.dynamic_update_index_in_dim(
            pool, jnp.where(live, s.astype(pool.dtype), old), slot, 0
        )
        return pool, out.at[r].set(jnp.where(live, o, 0.0))

    out = jnp.zeros(v.shape, jnp.float32)
    pool, out = lax.fori_loop(0, q.shape[0], row, (state_pool, out))
    return out.astype(v.dtype), pool
