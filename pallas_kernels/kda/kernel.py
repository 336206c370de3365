"""Pallas (Triton) kernels for Kimi Delta Attention: chunked varlen prefill and pooled-state decode.

Prefill grid (sequence, value head, V slice). Each program walks its sequence's chunks of C tokens
with the state slice [V/split, K] held in float32, and per chunk runs the WY/UT form of kernels.md
A.2 with every matrix product a 2-D dot. Stability for any gate g <= 0 (the unbounded default too):
the cumulative decay G is taken within the chunk, and no exponent ever exceeds 0 -- the intra-chunk
matrices use exp(min(G_i - G_j, 0)) one column at a time instead of the factored exp(G_i)exp(-G_j),
which overflows float32 once a chunk's decay passes e^88 (C = 16 at g = -20 would reach e^300).
The state-dependent products run per 16-wide value tile (see TILE), so a split changes no bit.

Decode grid (row, value head, V slice): one recurrent step on the state slot named by the row's
index, written back into the donated pool; slot -1 is a padding row that writes zeros to its
output and touches no state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.kda import heuristics, shapes
from pallas_kernels.masked_values import nonfinite
from pallas_kernels.platform import num_cores, resolve_interpret, triton_params

HI = lax.Precision.HIGHEST
CHUNK_SIZES = (16, 32, 64)
# Value columns are processed in fixed 16-wide tiles, so every v_split runs the same dots on the
# same shapes and gives bit-identical numbers (dot rounding may depend on a dot's width).
TILE = heuristics.MIN_SLICE


def _pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def _dot(a, b, ca: int, cb: int):
    """2-D dot contracting a's axis `ca` with b's axis `cb`, IEEE float32 (no TF32)."""
    dims = (((ca,), (cb,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=HI, preferred_element_type=jnp.float32)


def _l2norm(x):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def resolve_v_split(v_split, num_heads: int, num_seqs: int, v_dim: int, interpret: bool) -> int:
    if v_split == "auto":
        if interpret:
            return 1
        return heuristics.kda_v_split(num_heads, max(num_seqs, 1), v_dim, num_cores())
    reason = heuristics.check_v_split(v_split, v_dim)
    if reason is not None:
        raise ValueError(f"kda: {reason}")
    return v_split


def check_dims(k_dim: int, v_dim: int) -> str | None:
    """Why the kernels cannot serve these head dims, or None."""
    for name, d in (("K", k_dim), ("V", v_dim)):
        if d < 16 or d > 256 or d & (d - 1):
            return f"head dim {name}={d} must be a power of two in [16, 256]"
    return None


def _num_warps(v_slice: int, k_dim: int) -> int:
    return 8 if v_slice * k_dim > 64 * 128 else 4


def _prefill_kernel(
    cu_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, o_ref, st_ref, *, c, scale, l2norm_qk
):
    bos = cu_ref[pl.program_id(0)]
    eos = cu_ref[pl.program_id(0) + 1]
    kd = q_ref.shape[-1]
    tiles = [pl.ds(i * TILE, TILE) for i in range(v_ref.shape[-1] // TILE)]
    rows = jnp.arange(c, dtype=jnp.int32)
    r2, c2 = rows[:, None], rows[None, :]
    eye = jnp.where(r2 == c2, 1.0, 0.0).astype(jnp.float32)

    def chunk(ci, state):
        t0 = bos + ci * c
        live = (t0 + rows) < eos
        mk = jnp.broadcast_to(live[:, None], (c, kd))
        mv = jnp.broadcast_to(live[:, None], (c, TILE))
        q = plt.load(q_ref.at[pl.ds(t0, c), :], mask=mk, other=0.0).astype(jnp.float32)
        k = plt.load(k_ref.at[pl.ds(t0, c), :], mask=mk, other=0.0).astype(jnp.float32)
        g = plt.load(g_ref.at[pl.ds(t0, c), :], mask=mk, other=0.0).astype(jnp.float32)
        b = plt.load(b_ref.at[pl.ds(t0, c)], mask=live, other=0.0).astype(jnp.float32)[:, None]
        # The chunk's products give a later token an exact 0 weight in earlier rows, but 0 * NaN
        # is NaN (masked_values.py): a token whose k, g or beta is not finite enters as zeros,
        # and the rows from it on are set to NaN below, as the recurrence makes them (a NaN q
        # only ever reaches its own row).
        bad = jnp.maximum(jnp.max(nonfinite(k) + nonfinite(g), axis=1), nonfinite(b)[:, 0])
        k, g, b = (jnp.where(bad[:, None] > 0, 0.0, x) for x in (k, g, b))
        since_bad = jnp.cumsum(bad, axis=0)[:, None] > 0
        chunk_bad = jnp.max(bad) > 0
        if l2norm_qk:
            q, k = _l2norm(q), _l2norm(k)
        q = q * scale
        cum = jnp.cumsum(g, axis=0)

        def column(j, acc):
            a, aqk = acc
            sel = r2 == j
            cum_j = jnp.sum(jnp.where(sel, cum, 0.0), axis=0, keepdims=True)
            k_j = jnp.sum(jnp.where(sel, k, 0.0), axis=0, keepdims=True)
            kd_j = jnp.exp(jnp.minimum(cum - cum_j, 0.0)) * k_j
            put = c2 == j
            a = jnp.where(put, jnp.sum(k * kd_j, axis=1, keepdims=True), a)
            aqk = jnp.where(put, jnp.sum(q * kd_j, axis=1, keepdims=True), aqk)
            return a, aqk

        zero = jnp.zeros((c, c), jnp.float32)
        a, aqk = lax.fori_loop(0, c, column, (zero, zero))
        a = jnp.where(r2 > c2, a * b, 0.0)
        aqk = jnp.where(r2 >= c2, aqk, 0.0)
        # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: A is strictly lower, so A^C = 0.
        tinv, p = eye - a, a
        for _ in range(c.bit_length() - 2):
            p = _dot(p, p, 1, 0)
            tinv = _dot(tinv, eye + p, 1, 0)
        decay = jnp.exp(cum)
        w = _dot(tinv, b * decay * k, 1, 0)
        q_dec = q * decay
        last = jnp.sum(jnp.where(r2 == c - 1, cum, 0.0), axis=0, keepdims=True)
        k_rest = jnp.exp(jnp.minimum(last - cum, 0.0)) * k
        keep = jnp.exp(last)
        new = []
        for cols, s in zip(tiles, state, strict=True):
            v = plt.load(v_ref.at[pl.ds(t0, c), cols], mask=mv, other=0.0).astype(jnp.float32)
            # A non-finite value reaches only its own column (one row of the state), from its
            # token on.
            v_bad = nonfinite(v)
            v = jnp.where(v_bad > 0, 0.0, v)
            vp = _dot(tinv, b * v, 1, 0) - _dot(w, s, 1, 1)
            o = _dot(q_dec, s, 1, 1) + _dot(aqk, vp, 1, 0)
            o = jnp.where(since_bad | (jnp.cumsum(v_bad, axis=0) > 0), jnp.nan, o)
            plt.store(o_ref.at[pl.ds(t0, c), cols], o.astype(o_ref.dtype), mask=mv)
            s = s * keep + _dot(vp, k_rest, 0, 0)
            new.append(jnp.where(chunk_bad | (jnp.max(v_bad, axis=0)[:, None] > 0), jnp.nan, s))
        return tuple(new)

    state = tuple(s0_ref[cols, :].astype(jnp.float32) for cols in tiles)
    state = lax.fori_loop(0, (eos - bos + c - 1) // c, chunk, state)
    for cols, s in zip(tiles, state, strict=True):
        st_ref[cols, :] = s.astype(st_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("scale", "l2norm_qk", "chunk_size", "v_split", "interpret")
)
def _prefill_call(
    q, k, v, g, beta, cu_seqlens, s0, *, scale, l2norm_qk, chunk_size, v_split, interpret
):
    t, h, kd = q.shape
    hv, vd = v.shape[1:]
    n = cu_seqlens.shape[0] - 1
    c, vs = chunk_size, vd // v_split
    tp = max(_pow2(t), c)
    grp = hv // h
    np1 = _pow2(n + 1)
    sq = pl.squeezed
    kernel = functools.partial(_prefill_kernel, c=c, scale=scale, l2norm_qk=l2norm_qk)
    o, st = pl.pallas_call(
        kernel,
        grid=(n, hv, v_split),
        in_specs=[
            pl.BlockSpec((np1,), lambda i, j, s: (0,)),
            pl.BlockSpec((tp, sq, kd), lambda i, j, s: (0, j // grp, 0)),
            pl.BlockSpec((tp, sq, kd), lambda i, j, s: (0, j // grp, 0)),
            pl.BlockSpec((tp, sq, vs), lambda i, j, s: (0, j, s)),
            pl.BlockSpec((tp, sq, kd), lambda i, j, s: (0, j, 0)),
            pl.BlockSpec((tp, sq), lambda i, j, s: (0, j)),
            pl.BlockSpec((sq, sq, vs, kd), lambda i, j, s: (i, j, s, 0)),
        ],
        out_specs=[
            pl.BlockSpec((tp, sq, vs), lambda i, j, s: (0, j, s)),
            pl.BlockSpec((sq, sq, vs, kd), lambda i, j, s: (i, j, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((t, hv, vd), v.dtype),
            jax.ShapeDtypeStruct((n, hv, vd, kd), jnp.float32),
        ],
        compiler_params=triton_params(num_warps=_num_warps(vs, kd)),
        interpret=interpret,
        name="kda_prefill",
    )(cu_seqlens, q, k, v, g, beta, s0)
    tok = jnp.arange(t, dtype=jnp.int32)[:, None, None]
    inside = (tok >= cu_seqlens[0]) & (tok < cu_seqlens[n])
    return jnp.where(inside, o, jnp.zeros((), o.dtype)), st


def kda_prefill(
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
    chunk_size: int = 16,
    v_split: int | str = "auto",
    interpret: bool | None = None,
):
    """Varlen chunked KDA: (o [T, HV, V] in v's dtype, final_state [N, HV, V, K] float32).

    Shapes as in reference.py; `initial_state` None means zero states. Sequences may be empty
    (their final state is their initial state) and of any length; output rows of tokens outside
    [cu_seqlens[0], cu_seqlens[N]) are zero.
    """
    n = shapes.check_prefill("kda_prefill", q, k, v, g, beta, cu_seqlens, initial_state)
    t, h, kd = q.shape
    hv, vd = v.shape[1:]
    reason = check_dims(kd, vd)
    if reason is not None:
        raise ValueError(f"kda_prefill: {reason}")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"kda_prefill: chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
    interpret = resolve_interpret(interpret)
    split = resolve_v_split(v_split, hv, n, vd, interpret)
    s0 = jnp.zeros((n, hv, vd, kd), jnp.float32) if initial_state is None else initial_state
    if t == 0 or n == 0:
        return jnp.zeros((t, hv, vd), v.dtype), s0.astype(jnp.float32)
    return _prefill_call(
        q, k, v, g, beta, cu_seqlens, s0,
        scale=float(scale), l2norm_qk=l2norm_qk, chunk_size=chunk_size, v_split=split,
        interpret=interpret,
    )  # fmt: skip


def _row_sum(x, halving: bool):
    """Sum over the last axis. With `halving` (interpret mode), by halving, so the order of the
    adds does not depend on the tile's row count: XLA:CPU vectorises a plain `sum` differently
    for 32, 64 or 128 rows, which broke the v-split's bit-exactness on AVX2 hosts. Triton has no
    slice lowering; there each row's `tl.sum` tree is over K alone.
    """
    width = x.shape[-1]
    if not halving or width & (width - 1):
        return jnp.sum(x, axis=-1)
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def _decode_kernel(
    idx_ref,
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    b_ref,
    pool_in_ref,
    o_ref,
    pool_ref,
    *,
    scale,
    l2norm_qk,
    halving,
):
    slot = idx_ref[pl.program_id(0)]
    live = slot >= 0
    at = jnp.maximum(slot, 0)
    q = q_ref[...].astype(jnp.float32)[None, :]
    k = k_ref[...].astype(jnp.float32)[None, :]
    if l2norm_qk:
        q, k = _l2norm(q), _l2norm(k)
    s = pool_in_ref[at].astype(jnp.float32) * jnp.exp(g_ref[...].astype(jnp.float32))[None, :]
    u = v_ref[...].astype(jnp.float32) - _row_sum(s * k, halving)
    s = s + (b_ref[...].astype(jnp.float32) * u)[:, None] * k
    o = _row_sum(s * (q * scale), halving)
    o_ref[...] = jnp.where(live, o, 0.0).astype(o_ref.dtype)

    @pl.when(live)
    def _():
        pool_ref[at] = s.astype(pool_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("scale", "l2norm_qk", "v_split", "interpret"), donate_argnums=5
)
def _decode_call(q, k, v, g, beta, pool, idx, *, scale, l2norm_qk, v_split, interpret):
    n, h, kd = q.shape
    hv, vd = v.shape[1:]
    vs = vd // v_split
    grp = hv // h
    slots = pool.shape[0]
    sq = pl.squeezed
    kernel = functools.partial(
        _decode_kernel, scale=scale, l2norm_qk=l2norm_qk, halving=bool(interpret)
    )
    pool_spec = pl.BlockSpec((slots, sq, vs, kd), lambda i, j, s: (0, j, s, 0))
    return pl.pallas_call(
        kernel,
        grid=(n, hv, v_split),
        in_specs=[
            pl.BlockSpec((_pow2(n),), lambda i, j, s: (0,)),
            pl.BlockSpec((sq, sq, kd), lambda i, j, s: (i, j // grp, 0)),
            pl.BlockSpec((sq, sq, kd), lambda i, j, s: (i, j // grp, 0)),
            pl.BlockSpec((sq, sq, vs), lambda i, j, s: (i, j, s)),
            pl.BlockSpec((sq, sq, kd), lambda i, j, s: (i, j, 0)),
            pl.BlockSpec((sq, sq, 1), lambda i, j, s: (i, j, 0)),
            pool_spec,
        ],
        out_specs=[pl.BlockSpec((sq, sq, vs), lambda i, j, s: (i, j, s)), pool_spec],
        out_shape=[
            jax.ShapeDtypeStruct((n, hv, vd), v.dtype),
            jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        ],
        input_output_aliases={6: 1},
        compiler_params=triton_params(num_warps=_num_warps(vs, kd)),
        interpret=interpret,
        name="kda_decode",
    )(idx, q, k, v, g, beta[:, :, None], pool)


def kda_decode(
    q,
    k,
    v,
    g,
    beta,
    state_pool,
    state_indices,
    *,
    scale: float,
    l2norm_qk: bool = True,
    v_split: int | str = "auto",
    interpret: bool | None = None,
):
    """One token per row: (o [N, HV, V] in v's dtype, state_pool updated in place).

    q, k [N, H, K], v [N, HV, V], g [N, HV, K], beta [N, HV]; `state_pool` [P, HV, V, K] is donated.
    Row i reads and writes slot state_indices[i]; -1 marks a padding row (zero output, no write).
    Live rows must name distinct slots.
    """
    n = shapes.check_decode("kda_decode", q, k, v, g, beta, state_pool, state_indices)
    kd, vd = q.shape[-1], v.shape[-1]
    reason = check_dims(kd, vd)
    if reason is not None:
        raise ValueError(f"kda_decode: {reason}")
    interpret = resolve_interpret(interpret)
    split = resolve_v_split(v_split, v.shape[1], n, vd, interpret)
    if n == 0:
        return jnp.zeros(v.shape, v.dtype), state_pool
    return _decode_call(
        q, k, v, g, beta, state_pool, state_indices,
        scale=float(scale), l2norm_qk=l2norm_qk, v_split=split, interpret=interpret,
    )  # fmt: skip
