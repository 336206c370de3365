"""Ragged paged attention in Pallas for the Triton lowering (CUDA and ROCm).

Grid (work item, kv head, kv split). A work item is up to `block_q` query tokens of one sequence; its
rows are (token, q head of the group) pairs, so a decode of a GQA group is one >= 16-row dot. Each
program walks its share of the sequence's pages (only those the item's causal / sliding window can
see) with an online softmax in f32, gathering `pages_per_tile` pages per step through the item's
block-table row. Splits write normalised partial outputs and log-sum-exps; XLA combines them and
scatters rows back to tokens. All metadata comes from ordinary blocked inputs (no scalar prefetch).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.masked_values import finite_values, poison_rows
from pallas_kernels.platform import num_cores, triton_params
from pallas_kernels.ragged_paged_attention.heuristics import Tiling, tiling
from pallas_kernels.ragged_paged_attention.work_items import (
    pow2_ceil,
    query_positions,
    work_items,
)


def _kernel(
    meta_ref,  # [4]: tokens in this item, context position of its first token, kv_len, unused
    table_ref,  # [padded max_blocks]: this item's block-table row
    q_ref,  # [rows, D]
    k_ref,  # [num_blocks, block_size, D] for this kv head
    v_ref,
    o_ref,  # [rows, D] f32, normalised within this split
    lse_ref,  # [rows] f32, -inf where the split saw no key
    *,
    group: int,
    pages_per_tile: int,
    num_splits: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    split = pl.program_id(2)
    rows, d = q_ref.shape
    bs = k_ref.shape[1]
    tile = pages_per_tile * bs
    ntok, pos0, kv_len = meta_ref[0], meta_ref[1], meta_ref[2]

    row_tok = lax.broadcasted_iota(jnp.int32, (rows,), 0) // group
    row_pos = pos0 + row_tok
    row_ok = row_tok < ntok
    hi = jnp.where(ntok > 0, jnp.minimum(kv_len, pos0 + ntok), 0)
    lo = jnp.zeros_like(hi) if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    lo = jnp.minimum(lo, hi)
    first, last = lo // tile, (hi + tile - 1) // tile
    per_split = (last - first + num_splits - 1) // num_splits
    t0 = first + split * per_split
    t1 = jnp.minimum(t0 + per_split, last)

    q = q_ref[...]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def body(t, carry):
        acc, m_prev, l_prev = carry
        pages = table_ref[pl.ds(t * pages_per_tile, pages_per_tile)]
        k = k_ref[pages].reshape(tile, d)
        v = v_ref[pages].reshape(tile, d)
        k_pos = t * tile + lax.broadcasted_iota(jnp.int32, (tile,), 0)
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_ok = k_pos < kv_len
        mask = row_ok[:, None] & key_ok[None, :] & (k_pos[None, :] <= row_pos[:, None])
        if sliding_window is not None:
            mask &= row_pos[:, None] - k_pos[None, :] < sliding_window
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m_prev - m_use)
        p = jnp.where(mask, jnp.exp(s - m_use[:, None]), 0.0)
        # Keys a row does not attend (past the context: stale pages; before its window; past its
        # causal diagonal) have p = 0, but 0 * NaN is not 0: see masked_values.py.
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

    init = (
        jnp.zeros((rows, d), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, l_sum = lax.fori_loop(t0, jnp.maximum(t0, t1), body, init)
    seen = l_sum > 0
    o_ref[...] = acc / jnp.where(seen, l_sum, 1.0)[:, None]
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l_sum, 1.0)), -jnp.inf)


def _combine(o, lse):
    """o [W, Hkv, splits, rows, D], lse [W, Hkv, splits, rows] -> [W, Hkv, rows, D]."""
    m = jnp.max(lse, axis=2, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m)  # 0 for splits that saw nothing
    den = jnp.sum(w, axis=2)
    return jnp.sum(o * w[..., None], axis=2) / jnp.where(den > 0, den, 1.0)[..., None]


def _call(q_items, meta, tables, k_cache, v_cache, t: Tiling, interpret: bool, **static):
    w, hkv, rows, d = q_items.shape
    nb, bs = k_cache.shape[:2]
    splits = t.num_splits
    kernel = functools.partial(
        _kernel,
        group=t.group,
        pages_per_tile=t.pages_per_tile,
        num_splits=splits,
        **static,
    )
    cache_spec = pl.BlockSpec((nb, bs, None, d), lambda i, h, s: (0, 0, h, 0))
    return pl.pallas_call(
        kernel,
        grid=(w, hkv, splits),
        in_specs=[
            pl.BlockSpec((None, meta.shape[1]), lambda i, h, s: (i, 0)),
            pl.BlockSpec((None, tables.shape[1]), lambda i, h, s: (i, 0)),
            pl.BlockSpec((None, None, rows, d), lambda i, h, s: (i, h, 0, 0)),
            cache_spec,
            cache_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, d), lambda i, h, s: (i, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, h, s: (i, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((w, hkv, splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((w, hkv, splits, rows), jnp.float32),
        ],
        compiler_params=triton_params(num_warps=4),
        interpret=interpret,
        name="ragged_paged_attention",
    )(meta, tables, q_items, k_cache, v_cache)


def ragged_paged_attention(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_kv_splits: int | str = "auto",
    interpret: bool = False,
):
    """Same contract as reference.ragged_paged_attention; `num_kv_splits` forces the split count."""
    tok, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    max_seqs, max_blocks = block_tables.shape
    g = hq // hkv
    t = tiling(
        num_tokens=tok,
        max_seqs=max_seqs,
        max_blocks=max_blocks,
        block_size=bs,
        hq=hq,
        hkv=hkv,
        cores=num_cores(),
        num_kv_splits=num_kv_splits,
    )
    seq, start, ntok = work_items(cu_q_lens, num_seqs, tok, t.block_q)
    pos0 = query_positions(seq, start, kv_lens, cu_q_lens)
    # Four columns: a power-of-two block (kernels.md C.2).
    meta = jnp.stack([ntok, pos0, kv_lens[seq], jnp.zeros_like(ntok)], axis=1).astype(jnp.int32)
    # Pad the table to a power of two (a multiple of `pages_per_tile`) so every tile loads whole
    # entries, and clamp it: entries past a sequence's pages (padding, maybe -1) are still loaded
    # as part of a tile, then masked by position, so they must at least address a real page.
    cols = max(pow2_ceil(max_blocks), t.pages_per_tile)
    tables = jnp.clip(block_tables.astype(jnp.int32), 0, nb - 1)
    tables = jnp.pad(tables, ((0, 0), (0, cols - max_blocks)))[seq]

    tok_idx = start[:, None] + jnp.arange(t.block_q)[None, :]  # [W, BQ]
    tok_ok = jnp.arange(t.block_q)[None, :] < ntok[:, None]
    qg = q.reshape(tok, hkv, g, d)
    if t.group != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, t.group - g), (0, 0)))
    qi = qg[jnp.clip(tok_idx, 0, tok - 1)]  # [W, BQ, Hkv, group, D]
    qi = jnp.where(tok_ok[:, :, None, None, None], qi, jnp.zeros_like(qi))
    q_items = qi.transpose(0, 2, 1, 3, 4).reshape(t.num_items, hkv, t.rows, d)

    o, lse = _call(
        q_items,
        meta,
        tables,
        k_cache,
        v_cache,
        t,
        interpret,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    o = _combine(o, lse).reshape(t.num_items, hkv, t.block_q, t.group, d)
    o = o.transpose(0, 2, 1, 3, 4)[:, :, :, :g].reshape(t.num_items * t.block_q, hq, d)
    dest = jnp.where(tok_ok, tok_idx, tok).reshape(-1)
    return jnp.zeros((tok, hq, d), q.dtype).at[dest].set(o.astype(q.dtype), mode="drop")
