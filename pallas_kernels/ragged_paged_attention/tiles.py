"""Attention of a step with multi-token rows on the jnp path at the cost of its causal area.

The reference's work items attend every key of the step's table width (its bucketed longest
context), so a prefill step of 2048 tokens in sequences of ~300 paid for 1024 keys per query:
~3x the matmuls of the whole layer. Here each sequence's query tokens are cut into tiles of
TILE_QUERIES, and each tile attends only the KV chunks (decode.py's chunks of CHUNK_KEYS keys) up
to its last query's position: one work item per live (tile, chunk) pair, laid end to end. A static
`num_pairs` (the batch builder counts the step's pairs with `tile_chunks` and buckets them) bounds
them. Each pair attends on its own (max, sum and value product) and a tile's pairs are combined
with their max-rescaled sums, as decode.py combines a sequence's chunks.

Keys are gathered as decode.py gathers them (whole block rows of the cache), once per pair: a
chunk is gathered by every tile that reads it, which costs less than the scores it feeds
(TILE_QUERIES queries per key). Tiles of TILE_QUERIES: measured on a 2048-token step of seven
~300-token prompts (8 q heads, 2 kv heads, dim 64), against 16 and 64.

Semantics are the reference's (reference.py): the plain value product is exact whenever the output
is all finite; otherwise the step is redone on the same gathered pairs with non-finite value rows
entering as zeros and the queries that attend one set to NaN (pallas_kernels/masked_values.py).
A `prefix_lens` call is not served here (a prefix widens a tile's horizon past its last query,
which the host's count does not see): the dispatcher sends it to the reference.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import decode, reference, rounding
from pallas_kernels.ragged_paged_attention.work_items import (
    query_positions,
    work_item_count,
    work_items,
)

TILE_QUERIES = 32


def tile_chunks(rows: Iterable[tuple[int, int]], block_size: int) -> int:
    """The (tile, KV chunk) pairs a step attends, from each row's (query tokens, context length
    including them): host-side ints, the count `ragged_paged_tiles` needs at least."""
    keys = decode.chunk_blocks(block_size) * block_size
    total = 0
    for q_len, kv_len in rows:
        first = kv_len - q_len
        for start in range(0, q_len, TILE_QUERIES):
            last = first + min(start + TILE_QUERIES, q_len) - 1
            total += last // keys + 1
    return total


def max_tile_chunks(num_tokens: int, max_seqs: int, max_blocks: int, block_size: int) -> int:
    """The most pairs a step of these padded shapes can hold (every tile at the widest table)."""
    per_chunk = decode.chunk_blocks(block_size)
    tiles = work_item_count(num_tokens, max_seqs, TILE_QUERIES)
    return tiles * -(-max_blocks // per_chunk)


def ragged_paged_tiles(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    num_pairs: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
):
    """The reference's result for a causal step whose live pairs (`tile_chunks`) number at most
    `num_pairs`; a step with more gets an all-NaN output rather than a silently truncated one."""
    step = _Pairs(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, num_pairs)
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    fast = step.output(*_product(step, step.k, step.v, finite_only=False, **options))
    # The exact product takes the gathered pairs, not the caches (decode.py: a branch taking the
    # caches made XLA:CPU copy both of them every layer).
    return jax.lax.cond(
        jnp.all(jnp.isfinite(fast)) | step.broken,
        lambda k, v: fast,
        lambda k, v: step.output(*_product(step, k, v, finite_only=True, **options)),
        step.k,
        step.v,
    )


class _Pairs:
    """One step's live (tile, chunk) pairs: their queries, keys and values gathered (f32), the
    mask of what each query attends, and how per-pair results become the output."""

    def __init__(self, q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, n):
        t, hq, d = q.shape
        _, bs, hkv, _ = k_cache.shape
        max_seqs, max_blocks = block_tables.shape
        c = TILE_QUERIES
        per_chunk = decode.chunk_blocks(bs)
        keys = per_chunk * bs
        tile_seq, tile_start, tile_ntok = work_items(cu_q_lens, num_seqs, t, c)
        num_tiles = tile_seq.shape[0]
        first_pos = query_positions(tile_seq, tile_start, kv_lens, cu_q_lens)
        counts = jnp.where(tile_ntok > 0, (first_pos + tile_ntok - 1) // keys + 1, 0)
        self.tile, chunk, live, count = decode.lay_out(counts, n)
        tile = self.tile
        seq = tile_seq[tile]
        cols = chunk[:, None] * per_chunk + jnp.arange(per_chunk)[None, :]
        blocks = block_tables[seq[:, None], jnp.minimum(cols, max_blocks - 1)]  # [N, P]
        self.k = decode.gather_rows(k_cache, blocks).astype(jnp.float32)  # [N, L, Hkv * D]
        self.v = decode.gather_rows(v_cache, blocks).astype(jnp.float32)
        rows = tile_start[:, None] + jnp.arange(c)[None, :]  # [W, C]
        row_ok = jnp.arange(c)[None, :] < tile_ntok[:, None]
        self.q = q[jnp.clip(rows, 0, t - 1)].astype(jnp.float32)  # [W, C, Hq, D]
        self.q_pos = (first_pos[:, None] + jnp.arange(c)[None, :])[tile]  # [N, C]
        self.query_ok = row_ok[tile] & live[:, None]
        self.k_pos = chunk[:, None] * keys + jnp.arange(keys)[None, :]  # [N, L]
        self.kv_len = kv_lens[seq][:, None]
        self.hkv, self.num_tiles, self.t, self.dtype = hkv, num_tiles, t, q.dtype
        self.rounding = rounding.for_pieces(
            q.dtype, self.k_pos, self.tile, num_tiles, max_blocks * bs
        )
        self.dest = jnp.where(row_ok, rows, t).reshape(-1)
        self.broken = count > n

    def mask(self, sliding_window):
        """bool[N, C, L]: the keys each pair's queries attend (causal, inside the context)."""
        mask = (self.k_pos < self.kv_len)[:, None, :] & self.query_ok[:, :, None]
        mask &= self.k_pos[:, None, :] <= self.q_pos[:, :, None]
        if sliding_window is not None:
            mask &= self.q_pos[:, :, None] - self.k_pos[:, None, :] < sliding_window
        return mask

    def output(self, o, m, total):
        """Per pair o [N, C, Hq, D] (unnormalised), max m and sum total [N, C, Hq] -> [T, Hq, D]."""

        # Padding pairs and padding queries read whatever their clipped indices name: kept out.
        o = jnp.where(self.query_ok[:, :, None, None], o, 0.0)
        out = decode.combine(o, m, total, self.tile, self.num_tiles)
        w, c, hq, d = out.shape
        result = jnp.zeros((self.t, hq, d), self.dtype)
        result = result.at[self.dest].set(out.reshape(w * c, hq, d).astype(self.dtype), mode="drop")
        return jnp.where(self.broken, jnp.nan, result)


def _product(step, k, v, *, finite_only, sm_scale, sliding_window, soft_cap):
    """Scores, softmax parts and value product of every pair: (o [N, C, Hq, D], m, sum [N, C, Hq]).
    `finite_only`: value rows holding NaN or inf enter as zeros and a query attending one gets NaN.
    The dots are batched over (pair, kv head) with one free dimension per operand: XLA:CPU ran the
    same einsum with (kv head, group, query) left apart ~2x slower."""
    n, length, e = k.shape
    hkv = step.hkv
    d = e // hkv
    w, c, hq, _ = step.q.shape
    g = hq // hkv
    q = step.q[step.tile].reshape(n, c, hkv, g, d).transpose(0, 2, 3, 1, 4)
    k = k.reshape(n, length, hkv, d).transpose(0, 2, 3, 1)  # [N, Hkv, D, L]
    v = v.reshape(n, length, hkv, d).transpose(0, 2, 1, 3)
    s = jnp.einsum(
        "bmd,bdl->bml",
        q.reshape(n * hkv, g * c, d),
        k.reshape(n * hkv, d, length),
        precision=reference._precision(),
    ).reshape(n, hkv, g, c, length)
    mask = step.mask(sliding_window)  # [N, C, L]
    p, m, total = decode.softmax_parts(s, mask[:, None, None], sm_scale, soft_cap, step.rounding)
    if finite_only:
        bad = ~jnp.all(jnp.isfinite(v), axis=-1)  # [N, Hkv, L]
        v = jnp.where(bad[..., None], 0.0, v)
    o = jnp.einsum(
        "bml,bld->bmd",
        p.reshape(n * hkv, g * c, length),
        v.reshape(n * hkv, length, d),
        precision=reference._precision(),
    ).reshape(n, hkv, g, c, d)
    if finite_only:
        hit = jnp.any(mask[:, None, :, :] & bad[:, :, None, :], axis=-1)  # [N, Hkv, C]
        o = jnp.where(hit[:, :, None, :, None], jnp.nan, o)
    o = o.transpose(0, 3, 1, 2, 4).reshape(n, c, hq, d)
    m = m.transpose(0, 3, 1, 2).reshape(n, c, hq)
    total = total.transpose(0, 3, 1, 2).reshape(n, c, hq)
    return o, m, total
