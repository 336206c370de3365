"""Attention of a step with multi-token rows on the jnp path at the cost of its causal area.

The reference's work items attend every key of the step's table width (its bucketed longest
context), so a prefill step of 2048 tokens in sequences of ~300 paid for 1024 keys per query:
~3x the matmuls of the whole layer. Here each sequence's query tokens are cut into tiles of
TILE_QUERIES, and each tile attends only the KV chunks (decode.py's chunks of CHUNK_KEYS keys) up
to its last query's position: one work item per live (tile, chunk) pair, laid end to end. A static
`num_pairs` (the batch builder counts the step's pairs with `tile_chunks` and buckets them) bounds
them. Each pair attends on its own (max, sum and value product) and a tile's pairs are combined
with their max-rescaled sums, as decode.py combines a sequence's chunks.

On the CPU, steps with f32 caches go to the C++ kernel instead (native.py); this path serves
the rest, as decode.py does.

Keys are gathered as decode.py gathers them (whole block rows of the cache), once per pair: a
chunk is gathered by every tile that reads it, which costs less than the scores it feeds
(TILE_QUERIES queries per key). Tiles of TILE_QUERIES: measured on a 2048-token step of seven
~300-token prompts (8 q heads, 2 kv heads, dim 64), against 16 and 64. Pairs are taken
SLICE_PAIRS at a time (`lax.map`): a slice's queries, keys, values, scores and probabilities
stay in the CPU's caches from one op to the next, where the whole step's went to memory between
each (the same step's attention layer: 32 ms against 38.7 in one slice; 8 pairs a slice 30.8,
32: 33.4). A bf16 step first takes every pair's run maxima in a pass of its own (the rounding's
running maximum spans a row's pairs: rounding.py), then the products.

Semantics are the reference's (reference.py): the plain value product is exact whenever the output
is all finite; otherwise the slice is redone on the same gathered values with non-finite value rows
entering as zeros and the queries that attend one set to NaN (pallas_kernels/masked_values.py).
A `prefix_lens` call is not served here (a prefix widens a tile's horizon past its last query,
which the host's count does not see): the dispatcher sends it to the C++ prefill kernel
(native.py) where that serves, else to the reference.
"""

from __future__ import annotations

import functools
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
SLICE_PAIRS = 16


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
    slice_pairs: int = SLICE_PAIRS,
    narrow_dots: bool = False,
):
    """The reference's result for a causal step whose live pairs (`tile_chunks`) number at most
    `num_pairs`; a step with more gets an all-NaN output rather than a silently truncated one.
    `slice_pairs`: pairs gathered at a time (module docstring); any value gives the same result.
    `narrow_dots` (bf16 or f16 queries whose caches hold values exact in their dtype): the dots
    take their operands in the queries' dtype (`decode.dot_dtypes`)."""
    step = _Pairs(q, k_cache, kv_lens, block_tables, cu_q_lens, num_seqs, num_pairs, slice_pairs)
    score_dtype, value_dtype = decode.dot_dtypes(q.dtype, step.rounding, narrow_dots)
    scores = functools.partial(_scores, step, sm_scale=sm_scale, soft_cap=soft_cap)
    mask = step.mask(sliding_window)  # [N, C, L]
    reference_maxima = None
    if step.rounding is not None:
        # bf16: a key's probability rounds relative to its row's running maximum over the keys
        # of earlier pairs too (rounding.py), so a first pass takes every pair's run maxima.
        def run_maxima(piece):
            blocks, tile, mask = piece
            k = decode.gather_rows(k_cache, blocks).astype(score_dtype)
            return step.rounding.run_maxima(scores(k, tile, mask))

        runs = jax.lax.map(run_maxima, step.sliced(step.blocks, step.tile, mask))
        reference_maxima = step.rounding.reference(runs.reshape(-1, *runs.shape[2:]))

    def product(piece):
        blocks, tile, mask, query_ok, ref = piece
        k = decode.gather_rows(k_cache, blocks).astype(score_dtype)  # [n, L, Hkv * D]
        v = decode.gather_rows(v_cache, blocks).astype(value_dtype)
        s = scores(k, tile, mask)
        m4 = mask[:, None, None]
        if ref is None:
            p, m, total = decode.masked_parts(s, m4)
        else:
            p, m, total = rounding.rounded_parts(s, m4, step.rounding.expand(ref), step.dtype)
        o = _values(p.astype(value_dtype), v, step.hkv)
        finite = jnp.all(jnp.isfinite(o) | ~query_ok[:, None, None, :, None]) | step.broken
        o, m, total = _heads_last(o, m, total)

        def finite_values_only(v):
            n, length, e = v.shape
            wide = v.reshape(n, length, step.hkv, e // step.hkv).astype(jnp.float32)
            return reference.product_of_finite_values(p, wide, mask).reshape(o.shape)

        # The exact product takes the slice's gathered values, not the caches (decode.py: a
        # branch taking the caches made XLA:CPU copy both of them every layer).
        return jax.lax.cond(finite, lambda v: o, finite_values_only, v), m, total

    pieces = step.sliced(step.blocks, step.tile, mask, step.query_ok, reference_maxima)
    o, m, total = jax.lax.map(product, pieces)
    return step.output(*(x.reshape(-1, *x.shape[2:]) for x in (o, m, total)))


class _Pairs:
    """One step's live (tile, chunk) pairs: their query rows, the blocks each gathers, the mask
    of what each query attends, and how per-pair results become the output. Pairs are laid out
    over `slices * per_slice` slots (decode.slicing), the slots past `n` always padding."""

    def __init__(self, q, k_cache, kv_lens, block_tables, cu_q_lens, num_seqs, n, most):
        t, hq, d = q.shape
        _, bs, hkv, _ = k_cache.shape
        max_seqs, max_blocks = block_tables.shape
        c = TILE_QUERIES
        per_chunk = decode.chunk_blocks(bs)
        keys = per_chunk * bs
        self.slices, self.per_slice = decode.slicing(n, most)
        tile_seq, tile_start, tile_ntok = work_items(cu_q_lens, num_seqs, t, c)
        num_tiles = tile_seq.shape[0]
        first_pos = query_positions(tile_seq, tile_start, kv_lens, cu_q_lens)
        counts = jnp.where(tile_ntok > 0, (first_pos + tile_ntok - 1) // keys + 1, 0)
        self.tile, chunk, live, count = decode.lay_out(counts, self.slices * self.per_slice)
        tile = self.tile
        seq = tile_seq[tile]
        cols = chunk[:, None] * per_chunk + jnp.arange(per_chunk)[None, :]
        self.blocks = block_tables[seq[:, None], jnp.minimum(cols, max_blocks - 1)]  # [N, P]
        rows = tile_start[:, None] + jnp.arange(c)[None, :]  # [W, C]
        row_ok = jnp.arange(c)[None, :] < tile_ntok[:, None]
        # Each slice gathers its pairs' query rows itself, instead of one whole-step copy of
        # every tile's queries ([W, C, Hq, D]: 4.7 MiB a layer at 2048 tokens).
        self.q, self.rows = q, jnp.clip(rows, 0, t - 1)  # [T, Hq, D], [W, C]
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

    def sliced(self, *xs):
        """Each [N, ...] -> [slices, per_slice, ...] (None stays None), for lax.map."""
        return tuple(
            None if x is None else x.reshape(self.slices, self.per_slice, *x.shape[1:]) for x in xs
        )

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


def _scores(step, k, tile, mask, *, sm_scale, soft_cap):
    """A slice of pairs' scaled scores [n, Hkv, G, C, L], -inf where `mask` [n, C, L] is false,
    from their gathered keys k [n, L, Hkv * D]. The dot is batched over (pair, kv head) with one
    free dimension per operand: XLA:CPU ran the same einsum with (kv head, group, query) left
    apart ~2x slower."""
    n, length, e = k.shape
    hkv = step.hkv
    d = e // hkv
    c, hq = step.rows.shape[1], step.q.shape[1]
    g = hq // hkv
    q = step.q[step.rows[tile]].astype(k.dtype)  # [n, C, Hq, D]
    q = q.reshape(n, c, hkv, g, d).transpose(0, 2, 3, 1, 4)
    k = k.reshape(n, length, hkv, d).transpose(0, 2, 3, 1)  # [n, Hkv, D, L]
    s = jnp.einsum(
        "bmd,bdl->bml",
        q.reshape(n * hkv, g * c, d),
        k.reshape(n * hkv, d, length),
        precision=reference._precision(),
        preferred_element_type=jnp.float32,
    ).reshape(n, hkv, g, c, length)
    return decode.masked_scores(s, mask[:, None, None], sm_scale, soft_cap)


def _values(p, v, hkv):
    """p [n, Hkv, G, C, L] @ the gathered values v [n, L, Hkv * D] -> o [n, Hkv, G, C, D] (f32)."""
    n, _, g, c, length = p.shape
    d = v.shape[-1] // hkv
    v = v.reshape(n, length, hkv, d).transpose(0, 2, 1, 3)
    o = jnp.einsum(
        "bml,bld->bmd",
        p.reshape(n * hkv, g * c, length),
        v.reshape(n * hkv, length, d),
        precision=reference._precision(),
        preferred_element_type=jnp.float32,
    )
    return o.reshape(n, hkv, g, c, d)


def _heads_last(o, m, total):
    """o [n, Hkv, G, C, D], m and total [n, Hkv, G, C] -> [n, C, Hq, D] and [n, C, Hq]."""
    n, hkv, g, c, d = o.shape
    o = o.transpose(0, 3, 1, 2, 4).reshape(n, c, hkv * g, d)
    m = m.transpose(0, 3, 1, 2).reshape(n, c, hkv * g)
    total = total.transpose(0, 3, 1, 2).reshape(n, c, hkv * g)
    return o, m, total
