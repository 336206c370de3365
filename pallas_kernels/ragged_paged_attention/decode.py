"""Decode attention on the jnp path at the cost of the live context, not of the bucketed table.

For a step whose every sequence has one query token (decode, or a prompt's last token), the
reference's work items gather each sequence's whole block-table row (padded to the step's block
bucket). Here the step's live context is cut into chunks of `chunk_blocks(block_size)` blocks of
one sequence each, laid end to end, and only those chunks are gathered: a static `num_chunks`
(the batch builder buckets the step's total, runtime/runner/inputs.py) bounds them. Each chunk
attends its sequence's query on its own (max, sum and value product per chunk) and the chunks of a
sequence are combined with their max-rescaled sums, as flash-decoding combines its KV splits.

Three XLA:CPU costs shape the layout, all measured (64 sequences, contexts 32..1024):
- Pages are gathered as rows of the [num_blocks, block_size * Hkv * D] view of the cache: one
  contiguous copy per block. The 4-D gather of the same pages ran up to 8x slower.
- A chunk's keys arrive as [keys, Hkv * D] (the cache's token-major order); a score dot batched
  over (chunk, kv head) would need them transposed to [Hkv, keys, D] first. The scores are an
  elementwise product summed over D instead, each query head against its own kv head's slot of
  the keys as laid out: XLA:CPU runs it as one fused multiply-reduce, 2.8 ms where the batched
  dot of each query head spread over a zero [Hkv * D] row took 8 (64 sequences, contexts
  200..760, 8 query and 2 kv heads of 64). The value product stays a dot batched over chunks,
  each query head's probabilities against every kv head's values (Hkv times the multiply-adds of
  a tiny dot, none of the copies); its own head's sum is kept.
- A chunk of 128 keys: one block per chunk made 16x more, smaller dots and ran 1.4x slower; the
  padding a sequence's last chunk wastes is under a chunk.

Semantics are the reference's (reference.py): the fast product is exact whenever the output is all
finite (a masked key's zero probability, or a probability meeting another kv head's values, only
multiplies a non-finite cache value into a non-finite output), and otherwise an exact product per
kv head on the same gathered chunks computes the step, keys and values a token does not attend
never changing its output (pallas_kernels/masked_values.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.bitcast import from_bits, to_bits
from pallas_kernels.ragged_paged_attention import reference, rounding

CHUNK_KEYS = 128


def chunk_blocks(block_size: int) -> int:
    """Blocks per chunk for a cache of this block size: CHUNK_KEYS keys, at least one block."""
    return max(1, CHUNK_KEYS // block_size)


def live_chunks(kv_lens, block_size: int) -> int:
    """The chunks a decode step over contexts of these lengths attends (host-side count, ints)."""
    keys = chunk_blocks(block_size) * block_size
    return sum(-(-n // keys) for n in kv_lens)


def gather_rows(cache, blocks):
    """cache [num_blocks, bs, Hkv, D], blocks int32[N, P] -> [N, P * bs, Hkv * D] (cache dtype)."""
    nb, bs, hkv, d = cache.shape
    n, p = blocks.shape
    rows = to_bits(cache).reshape(nb, bs * hkv * d)[blocks]
    return from_bits(rows, cache.dtype).reshape(n, p * bs, hkv * d)


def lay_out(counts, n: int):
    """Pieces laid end to end over `n` static slots, owner i holding counts[i] of them (int32[O]):
    per slot its owner, its index among the owner's pieces and whether it holds one (slots past
    the last piece are padding: owner clipped to O - 1, index 0), and the number of pieces."""
    ends = jnp.cumsum(counts)
    ids = jnp.arange(n, dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(ends, ids, side="right"), counts.shape[0] - 1)
    owner = owner.astype(jnp.int32)
    live = ids < ends[-1]
    index = jnp.where(live, ids - (ends[owner] - counts[owner]), 0)
    return owner, index, live, ends[-1]


def combine(o, m, total, owner, num_owners: int):
    """Each owner's pieces' softmax parts -> its normalised output: per piece o [N, ..., D]
    (unnormalised, padding pieces zeroed), max m and sum total [N, ...], pieces sorted by owner,
    rescaled to their owner's max as flash-decoding combines its KV splits -> [O, ..., D]."""

    def per_owner(x, reduce=jax.ops.segment_sum):
        return reduce(x, owner, num_segments=num_owners, indices_are_sorted=True)

    m_owner = per_owner(m, jax.ops.segment_max)
    scale = jnp.exp(m - jnp.where(jnp.isfinite(m_owner), m_owner, 0.0)[owner])  # 0: empty
    den = per_owner(total * scale)
    return per_owner(o * scale[..., None]) / jnp.where(den > 0, den, 1.0)[..., None]


def _own_heads(o, hkv):
    """o [N, Hq, Hkv * D] -> [N, Hq, D]: each q head's slot of its own kv head."""
    n, hq, e = o.shape
    d, g = e // hkv, hq // hkv
    own = jnp.eye(hkv, dtype=bool)[None, :, None, :, None]  # [1, Hkv, 1, Hkv, 1]
    return jnp.sum(jnp.where(own, o.reshape(n, hkv, g, hkv, d), 0.0), axis=3).reshape(n, hq, d)


def ragged_paged_decode(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    num_chunks: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    prefix_lens=None,
):
    """The reference's result for a step where every sequence has at most one query token and
    whose live chunks (`live_chunks`) number at most `num_chunks`. A step breaking either promise
    gets an all-NaN output rather than a silently truncated one. `prefix_lens` changes nothing
    here: a sequence's one query is its last position, which already sees its whole context."""
    step = _Chunks(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, num_chunks)
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    fast = step.output(*_fast_product(step, **options))
    # The exact product reads only the gathered chunks: a branch taking the caches themselves
    # made XLA:CPU copy both caches of every layer into it each step (+30% on the attention).
    return jax.lax.cond(
        jnp.all(jnp.isfinite(fast)) | step.broken,
        lambda chunk_keys, chunk_values: fast,
        lambda chunk_keys, chunk_values: step.output(
            *_exact_product(step, chunk_keys, chunk_values, **options)
        ),
        step.k,
        step.v,
    )


def live_chunk_attention(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    num_chunks: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
):
    """(output, broken): the fast product alone, equal to the reference's whenever it is all
    finite; `broken` says the step broke `ragged_paged_decode`'s promises (output all NaN)."""
    step = _Chunks(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, num_chunks)
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    return step.output(*_fast_product(step, **options)), step.broken


class _Chunks:
    """One step's live chunks: which sequence and part of its context each holds, their keys and
    values gathered ([N, L, Hkv * D], f32), and how per-chunk results become the output."""

    def __init__(self, q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, n):
        t, hq, d = q.shape
        _, bs, hkv, _ = k_cache.shape
        max_seqs, max_blocks = block_tables.shape
        per_chunk = chunk_blocks(bs)
        keys = per_chunk * bs
        present = jnp.arange(max_seqs) < num_seqs
        q_lens = jnp.where(present, cu_q_lens[1:] - cu_q_lens[:-1], 0)
        lens = jnp.where(present, kv_lens, 0)
        self.seq, chunk, self.live, count = lay_out((lens + keys - 1) // keys, n)
        cols = chunk[:, None] * per_chunk + jnp.arange(per_chunk)[None, :]
        blocks = block_tables[self.seq[:, None], jnp.minimum(cols, max_blocks - 1)]  # [N, P]
        self.k = gather_rows(k_cache, blocks).astype(jnp.float32)  # [N, L, Hkv * D]
        self.v = gather_rows(v_cache, blocks).astype(jnp.float32)
        self.q_seq = q[jnp.clip(cu_q_lens[:-1], 0, t - 1)].astype(jnp.float32)  # [S, Hq, D]
        self.k_pos = chunk[:, None] * keys + jnp.arange(keys)[None, :]  # [N, L]
        self.kv_len = lens[self.seq][:, None]
        self.hkv, self.max_seqs, self.t, self.dtype = hkv, max_seqs, t, q.dtype
        self.rounding = rounding.for_pieces(
            q.dtype, self.k_pos, self.seq, max_seqs, max_blocks * bs
        )
        self.dest = jnp.where(present & (q_lens > 0), cu_q_lens[:-1], t)
        self.broken = jnp.any(q_lens > 1) | (count > n)

    def mask(self, sliding_window):
        """bool[N, L]: the keys each chunk's query attends."""
        mask = self.live[:, None] & (self.k_pos < self.kv_len)
        if sliding_window is not None:
            mask &= (self.kv_len - 1) - self.k_pos < sliding_window
        return mask

    def output(self, o, m, total):
        """Per chunk o [N, Hq, D] (unnormalised), max m and sum total [N, Hq] -> [T, Hq, D]."""
        # Padding chunks read whatever blocks their clipped table entries name: kept out.
        o = jnp.where(self.live[:, None, None], o, 0.0)
        out = combine(o, m, total, self.seq, self.max_seqs)
        _, hq, d = out.shape
        fast = jnp.zeros((self.t, hq, d), self.dtype)
        fast = fast.at[self.dest].set(out.astype(self.dtype), mode="drop")
        return jnp.where(self.broken, jnp.nan, fast)


def softmax_parts(s, mask, sm_scale, soft_cap, rounded=None):
    """Scores s [..., L] (mask broadcasting to them) -> (p, max, sum) of one chunk's keys;
    `rounded` (bf16 queries: a rounding.Rounding) rounds p where HF's attention does."""
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, -jnp.inf)
    if rounded is not None:
        return rounded.parts(s, mask)
    m = jnp.max(s, axis=-1)  # -inf for a chunk with nothing attended
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]), 0.0)
    return p, m, jnp.sum(p, axis=-1)


def _fast_product(step, *, sm_scale, sliding_window, soft_cap):
    """Both products over the chunks' layout as gathered (module docstring); exact when finite."""
    n, length, e = step.k.shape
    hkv = step.hkv
    hq = step.q_seq.shape[1]
    d, g = e // hkv, hq // hkv
    qh = step.q_seq[step.seq].reshape(n, 1, hkv, g, d)
    s = jnp.sum(qh * step.k.reshape(n, length, hkv, 1, d), axis=-1)  # [N, L, Hkv, G]
    s = jnp.moveaxis(s.reshape(n, length, hq), 1, 2)  # [N, Hq, L]
    mask = step.mask(sliding_window)[:, None, :]  # the same keys for every head
    p, m, total = softmax_parts(s, mask, sm_scale, soft_cap, step.rounding)
    o = jnp.einsum("nql,nle->nqe", p, step.v, precision=reference._precision())
    return _own_heads(o, hkv), m, total


def _exact_product(step, k, v, *, sm_scale, sliding_window, soft_cap):
    """Per kv head, with non-finite value rows entering as zeros and NaN for the heads that
    attend one (pallas_kernels/masked_values.py): the reference's rule on the chunks."""
    n, length, e = k.shape
    hkv = step.hkv
    d = e // hkv
    hq = step.q_seq.shape[1]
    qh = step.q_seq[step.seq].reshape(n, hkv, hq // hkv, d)
    k, v = k.reshape(n, length, hkv, d), v.reshape(n, length, hkv, d)
    s = jnp.einsum("nkgd,nlkd->nkgl", qh, k, precision=reference._precision())
    mask = step.mask(sliding_window)  # [N, L]
    p, m, total = softmax_parts(s, mask[:, None, None, :], sm_scale, soft_cap, step.rounding)
    bad = ~jnp.all(jnp.isfinite(v), axis=-1)  # [N, L, Hkv]
    v = jnp.where(bad[..., None], 0.0, v)
    o = jnp.einsum("nkgl,nlkd->nkgd", p, v, precision=reference._precision())
    hit = jnp.any(mask[:, :, None] & bad, axis=1)  # [N, Hkv]
    o = jnp.where(hit[:, :, None, None], jnp.nan, o)
    return o.reshape(n, hq, d), m.reshape(n, hq), total.reshape(n, hq)
