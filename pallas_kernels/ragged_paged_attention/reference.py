"""Plain-jnp ragged paged attention: the oracle for the Pallas kernel and the default path on CPU.

The flat token batch is cut into work items of `chunk` query tokens of one sequence each (a sequence
of q_len tokens makes ceil(q_len / chunk) items). Each item gathers its sequence's pages once and
attends with one batched einsum, so a long prefill does not gather its context once per token, and a
decode batch does not pay for a query block per sequence larger than it needs. The chunk size is
chosen statically from the shapes to balance those two costs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.bitcast import from_bits, to_bits
from pallas_kernels.ragged_paged_attention import rounding
from pallas_kernels.ragged_paged_attention.work_items import (
    pow2_ceil,
    query_positions,
    work_item_count,
    work_items,
)


def _precision():
    """f32 dots on GPUs default to TF32, too coarse for an oracle; the CPU's default is full f32
    and its HIGHEST path measured 2.5x slower on a batched decode einsum."""
    return None if jax.default_backend() == "cpu" else jax.lax.Precision.HIGHEST


def choose_chunk(num_tokens: int, max_seqs: int, ctx: int, hq: int, hkv: int, d: int) -> int:
    """Query tokens per work item minimising score work (items x chunk x ctx x hq) plus the gathered
    context (items x ctx x hkv x d), both static functions of the shapes."""
    best, best_cost = 1, None
    c = 1
    while c <= pow2_ceil(num_tokens):
        w = work_item_count(num_tokens, max_seqs, c)
        cost = w * ctx * (c * hq + hkv * d)
        if best_cost is None or cost < best_cost:
            best, best_cost = c, cost
        c *= 2
    return best


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
    prefix_lens=None,
    round_probabilities: bool = True,
):
    """q [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]; output [T, Hq, D] in q's dtype.

    Sequence s's query tokens are the last q_len positions of its kv_lens[s] context (causal).
    With `prefix_lens` int32[S] (a prefix LM: PaliGemma, ColPali), sequence s's first
    prefix_lens[s] positions attend to each other both ways: a token sees every key up to
    max(its position, prefix_lens[s] - 1); the rest stays causal.
    Tokens past cu_q_lens[num_seqs] produce zeros. A key a token does not attend never changes its
    output, whatever the cache holds there; a token that attends a value holding NaN or inf gets
    NaN (pallas_kernels/masked_values.py).
    Queries narrower than f32 have their probabilities rounded as HF's flash kernel rounds them
    (rounding.py) unless `round_probabilities` is False (kept f32, as HF's math path).
    """
    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    max_seqs, max_blocks = block_tables.shape
    g = hq // hkv
    ctx = max_blocks * bs
    chunk = choose_chunk(t, max_seqs, ctx, hq, hkv, d)
    seq, start, ntok = work_items(cu_q_lens, num_seqs, t, chunk)
    w = seq.shape[0]

    rows = start[:, None] + jnp.arange(chunk)[None, :]  # [W, C]
    row_ok = jnp.arange(chunk)[None, :] < ntok[:, None]
    qw = q[jnp.clip(rows, 0, t - 1)].reshape(w, chunk, hkv, g, d)

    pages = block_tables[seq]  # [W, MB]
    kw = from_bits(to_bits(k_cache)[pages], k_cache.dtype).reshape(w, ctx, hkv, d)
    vw = from_bits(to_bits(v_cache)[pages], v_cache.dtype).reshape(w, ctx, hkv, d)

    kv_len = kv_lens[seq]
    q_pos = query_positions(seq, start, kv_lens, cu_q_lens)[:, None] + jnp.arange(chunk)[None, :]
    k_pos = jnp.arange(ctx)
    key_ok = k_pos[None, :] < kv_len[:, None]  # [W, L]
    horizon = q_pos
    if prefix_lens is not None:
        horizon = jnp.maximum(q_pos, prefix_lens[seq][:, None] - 1)
    mask = key_ok[:, None, :] & (k_pos[None, None, :] <= horizon[:, :, None])
    if sliding_window is not None:
        mask &= q_pos[:, :, None] - k_pos[None, None, :] < sliding_window
    mask &= row_ok[:, :, None]  # [W, C, L]

    s = jnp.einsum(
        "wckgd,wlkd->wkgcl",
        qw.astype(jnp.float32),
        kw.astype(jnp.float32),
        precision=_precision(),
    )
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    m4 = mask[:, None, None, :, :]
    s = jnp.where(m4, s, -jnp.inf)
    if round_probabilities and rounding.rounds(q.dtype):
        # bf16: the probabilities rounded where HF's rounds them (rounding.py), then normalised.
        k_pos = jnp.broadcast_to(k_pos[None, :], (w, ctx))
        hf = rounding.Rounding(k_pos, jnp.arange(w), w, ctx, q.dtype)
        p, _, den = hf.parts(s, m4)
        den = den[..., None]
    else:
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.where(m4, jnp.exp(s - m), 0.0)
        den = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(den > 0, den, 1.0)
    # Keys a token does not attend (stale pages past the context, keys before its window or past
    # its causal diagonal) have p = 0, but 0 * NaN is not 0. The plain product is exact whenever
    # its output is all finite: one non-finite value anywhere in a work item's gathered rows makes
    # the whole item's output non-finite. Only then is the product redone keeping non-finite values
    # out, from a second gather, so the common path reads the values once, in the layout the dot
    # wants (a condition on the values themselves, or the safe product every time, costs decode
    # attention one to three more passes over them: +20-65% on XLA:CPU).
    o = jnp.einsum("wkgcl,wlkd->wckgd", p, vw.astype(jnp.float32), precision=_precision())

    def finite_values_only():
        again = from_bits(to_bits(v_cache)[pages], v_cache.dtype).reshape(w, ctx, hkv, d)
        return product_of_finite_values(p, again.astype(jnp.float32), mask)

    o = jax.lax.cond(jnp.all(jnp.isfinite(o)), lambda: o, finite_values_only)

    dest = jnp.where(row_ok, rows, t).reshape(-1)
    out = jnp.zeros((t, hq, d), q.dtype)
    return out.at[dest].set(o.reshape(w * chunk, hq, d).astype(q.dtype), mode="drop")


def product_of_finite_values(p, vw, mask):
    """p [W, Hkv, G, C, L] @ vw [W, L, Hkv, D] -> [W, C, Hkv, G, D], with non-finite value rows
    entering as zeros, and NaN for the tokens that attend one (mask [W, C, L]); see
    pallas_kernels/masked_values.py. The jnp fast paths (decode.py, tiles.py) redo a slice with
    it when their plain product is not all finite."""
    v_bad = ~jnp.all(jnp.isfinite(vw), axis=-1)  # [W, L, Hkv]
    vw = jnp.where(v_bad[..., None], 0.0, vw)
    o = jnp.einsum("wkgcl,wlkd->wckgd", p, vw, precision=_precision())
    attends_bad = jnp.any(mask[:, None] & v_bad.transpose(0, 2, 1)[:, :, None, :], axis=-1)
    return jnp.where(attends_bad.transpose(0, 2, 1)[..., None, None], jnp.nan, o)
