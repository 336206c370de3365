"""Dense (flash) attention in Pallas for the Triton lowering: encoders and pooling models.

Grid (batch, q head, q block). Each program holds one [block_q, D] query tile and walks key tiles
with an online softmax in f32; a causal walk stops at the diagonal. Sequence tails that are not a
multiple of the block are handled with masked loads and stores on whole-sequence blocks. A key a
row does not attend never changes it, whatever its K/V hold (masked_values.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.flash_attention.heuristics import block_sizes
from pallas_kernels.masked_values import finite_values, poison_rows
from pallas_kernels.platform import triton_params


def _kernel(
    q_ref,  # [S, D] for this (batch, head)
    k_ref,  # [S, D] for this (batch, kv head)
    v_ref,
    qseg_ref,  # [S]
    kseg_ref,  # [S]
    o_ref,  # [S, D]
    *,
    block_q: int,
    block_k: int,
    causal: bool,
    sm_scale: float,
    use_segments: bool,
):
    s_len, d = q_ref.shape
    qi = pl.program_id(2)
    q_rows = qi * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    q_ok = q_rows < s_len
    q = plt.load(q_ref.at[pl.ds(qi * block_q, block_q), :], mask=q_ok[:, None], other=0.0)
    q_seg = plt.load(qseg_ref.at[pl.ds(qi * block_q, block_q)], mask=q_ok, other=0)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def body(j, carry):
        acc, m_prev, l_prev = carry
        k_rows = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        k_ok = k_rows < s_len
        tile = pl.ds(j * block_k, block_k)
        k = plt.load(k_ref.at[tile, :], mask=k_ok[:, None], other=0.0)
        v = plt.load(v_ref.at[tile, :], mask=k_ok[:, None], other=0.0)
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        s = s * sm_scale
        mask = jnp.broadcast_to(k_ok[None, :], s.shape)
        if causal:
            mask &= k_rows[None, :] <= q_rows[:, None]
        if use_segments:
            k_seg = plt.load(kseg_ref.at[tile], mask=k_ok, other=0)
            mask &= q_seg[:, None] == k_seg[None, :]
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m_prev - m_use)
        p = jnp.where(mask, jnp.exp(s - m_use[:, None]), 0.0)
        # p is 0 for a masked key but 0 * NaN is not: see masked_values.py.
        v, v_bad = finite_values(v)
        pv = lax.dot_general(
            p.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        pv = poison_rows(pv, mask, v_bad)
        return acc * alpha[:, None] + pv, m_new, l_prev * alpha + jnp.sum(p, axis=1)

    n_k = pl.cdiv(s_len, block_k)
    if causal:
        n_k = jnp.minimum(n_k, pl.cdiv((qi + 1) * block_q, block_k))
    init = (
        jnp.zeros((block_q, d), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    acc, _, l_sum = lax.fori_loop(0, n_k, body, init)
    out = acc / jnp.where(l_sum > 0, l_sum, 1.0)[:, None]
    plt.store(
        o_ref.at[pl.ds(qi * block_q, block_q), :], out.astype(o_ref.dtype), mask=q_ok[:, None]
    )


def flash_attention(q, k, v, *, causal: bool, sm_scale: float, segment_ids=None, interpret=False):
    """Same contract as reference.flash_attention."""
    b, s, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    block_q, block_k = block_sizes(s)
    use_segments = segment_ids is not None
    seg = segment_ids.astype(jnp.int32) if use_segments else jnp.zeros((b, s), jnp.int32)
    kernel = functools.partial(
        _kernel,
        block_q=block_q,
        block_k=block_k,
        causal=causal,
        sm_scale=sm_scale,
        use_segments=use_segments,
    )
    seq_spec = pl.BlockSpec((None, s), lambda bi, hi, qi: (bi, 0))
    return pl.pallas_call(
        kernel,
        grid=(b, h, pl.cdiv(s, block_q)),
        in_specs=[
            pl.BlockSpec((None, s, None, d), lambda bi, hi, qi: (bi, 0, hi, 0)),
            pl.BlockSpec((None, s, None, d), lambda bi, hi, qi: (bi, 0, hi // g, 0)),
            pl.BlockSpec((None, s, None, d), lambda bi, hi, qi: (bi, 0, hi // g, 0)),
            seq_spec,
            seq_spec,
        ],
        out_specs=pl.BlockSpec((None, s, None, d), lambda bi, hi, qi: (bi, 0, hi, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=triton_params(num_warps=4),
        interpret=interpret,
        name="flash_attention",
    )(q, k, v, seg, seg)
