"""Decode attention on the jnp path at the cost of the live context, not of the bucketed table.

For a step whose every sequence has one query token (decode, or a prompt's last token), the
reference's work items gather each sequence's whole block-table row (padded to the step's block
bucket). Here the step's live context is cut into chunks of `chunk_blocks(block_size)` blocks of
one sequence each, laid end to end, and only those chunks are gathered: a static `num_chunks`
(the batch builder buckets the step's total, runtime/runner/inputs.py) bounds them. Each chunk
attends its sequence's query on its own (max, sum and value product per chunk) and the chunks of a
sequence are combined with their max-rescaled sums, as flash-decoding combines its KV splits.

On the CPU, steps with f32 caches go to the C++ kernel instead (native.py), which reads the
pages in place; this path serves the rest (bf16 or f16 caches, a GPU's reference fallback, a host
without a C++ compiler) and is the kernel's second oracle in the tests.

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
- Keys and values are gathered a slice of chunks at a time (`lax.map`), each slice's copy
  read by its product while it is still in the CPU's caches: the whole step's gathered copy
  (16 MiB of keys and as much of values at 64 x ~500 tokens) went to memory and back. Two passes,
  scores then values, with the scores kept whole between them. How much a slice should gather
  depends on the host (`slice_chunks`), measured per layer with 8 query and 2 kv heads of 64,
  f32 (64 KiB of keys a chunk), 64 sequences:
  - 2-core AMD EPYC, AVX2 (512 KiB L2 a core), contexts 200..760: 7.4 ms at 16 chunks a slice
    (1 MiB of keys), 8.2 at 8, 7.8 at 32, 10.4 for the whole-step gathers.
  - 2-core Intel Xeon with AVX-512 and AMX (2 MiB L2 a core), contexts 100..600 (median of 15):
    6.9 ms at 16 chunks, 6.4 at 8, 4.95 at 4, 5.2 at 2, 7.6 at 1; contexts 30..200: 3.5 at 16,
    2.35 at 4; 400..1000: 13.5 at 16, 9.9 at 3, 11.6 at 4. With one kv head (32 KiB a chunk):
    10.2 at 16, 5.9 at 2, 6.8 at 4; eight kv heads of 128 (512 KiB): 62.7 at 16, ~59 at 2..8,
    91.6 at 1. The benchmark Llama's whole offline run: decode steps 50.5-54 ms at 4 and 51.8-55.2
  at 2, against 56-57.6 at 16.
  Its XLA fusions (YNNPACK reductions and dots) run faster on small slices there; the AVX2 host
  was not measured below 8. So a slice holds SLICE_BYTES of keys on an AVX-512 host and
  SLICE_BYTES_AVX2 elsewhere, at least MIN_SLICE_CHUNKS chunks.

Semantics are the reference's (reference.py): the fast value product is exact whenever its output
is all finite (a masked key's zero probability, or a probability meeting another kv head's values,
only multiplies a non-finite cache value into a non-finite output), and a slice whose output is not
is redone with an exact product per kv head on the same gathered values, keys and values a token
does not attend never changing its output (pallas_kernels/masked_values.py). Masked scores are
-inf before the softmax, so a non-finite key a token does not attend never reaches it either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import platform
from pallas_kernels.bitcast import from_bits, to_bits
from pallas_kernels.ragged_paged_attention import reference, rounding

CHUNK_KEYS = 128
SLICE_BYTES = 128 * 1024  # keys gathered per slice on an AVX-512 host (module docstring)
SLICE_BYTES_AVX2 = 1024 * 1024  # elsewhere: 16 chunks of 64 KiB, as measured on AVX2
MIN_SLICE_CHUNKS = 2  # one chunk a slice ran 1.5x slower than two (AVX-512 host)


def chunk_blocks(block_size: int) -> int:
    """Blocks per chunk for a cache of this block size: CHUNK_KEYS keys, at least one block."""
    return max(1, CHUNK_KEYS // block_size)


def slice_chunks(chunk_bytes: int, flags: frozenset[str]) -> int:
    """Chunks gathered per slice on a host with these CPU flags, for chunks of `chunk_bytes` of
    keys (module docstring)."""
    target = SLICE_BYTES if "avx512f" in flags else SLICE_BYTES_AVX2
    return max(MIN_SLICE_CHUNKS, target // max(1, chunk_bytes))


def host_slice_chunks(k_cache) -> int:
    """`slice_chunks` for this host and a cache of this shape and dtype."""
    _, bs, hkv, d = k_cache.shape
    chunk_bytes = chunk_blocks(bs) * bs * hkv * d * jnp.dtype(k_cache.dtype).itemsize
    return slice_chunks(chunk_bytes, platform.host_cpu_flags())


def dot_dtypes(dtype, rounded, narrow: bool):
    """(score dot, value dot) operand dtypes of a jnp-path step whose queries are `dtype`,
    `rounded` its probabilities' rounding.Rounding (None for f32), `narrow` the caller's word
    that its caches hold values exact in `dtype` (a bf16 model's keys and values, in a bf16 or
    an f32 cache). Narrow operands give the same products (exact in f32) accumulated in f32
    as before, at the host's bf16 dot speed (AMX: 2-4x an f32 dot). The probabilities are exact
    in `dtype` only where no piece spans two of HF's key blocks (each rounds against one
    maximum, rescaled by nothing): otherwise the value dot stays f32."""
    if not narrow or rounded is None:
        return jnp.float32, jnp.float32
    exact_p = rounded.width == rounded.k_pos.shape[1]
    return dtype, (dtype if exact_p else jnp.float32)


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
    slice_chunks: int | None = None,
    narrow_dots: bool = False,
    exact: bool = True,
):
    """The reference's result for a step where every sequence has at most one query token and
    whose live chunks (`live_chunks`) number at most `num_chunks`. A step breaking either promise
    gets an all-NaN output rather than a silently truncated one. `prefix_lens` changes nothing
    here: a sequence's one query is its last position, which already sees its whole context.
    `slice_chunks`: chunks gathered at a time, this host's choice by default (`host_slice_chunks`);
    any value gives the same result. `narrow_dots`: see `dot_dtypes`. `exact=False`: the fast
    product alone, without the exact redo of a slice whose output is not all finite (the tests'
    view of it; equal to the reference's wherever it is all finite)."""
    step = _Chunks(q, kv_lens, block_tables, cu_q_lens, num_seqs, num_chunks, slice_chunks, k_cache)
    options = dict(
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, narrow_dots=narrow_dots
    )
    return step.output(*_product(step, k_cache, v_cache, exact=exact, **options))


def slicing(n: int, most: int) -> tuple[int, int]:
    """(slices, pieces per slice) for `n` pieces taken at most `most` at a time: the fewest
    slices, as even as they go (the last may hold padding pieces: slices * per_slice >= n)."""
    slices = -(-n // max(1, most))
    return slices, -(-n // slices)


class _Chunks:
    """One step's live chunks: which sequence and part of its context each holds, the blocks to
    gather for it, and how per-chunk results become the output. Chunks are laid out over
    `slices * per_slice` slots (`slicing`), the slots past `n` always padding."""

    def __init__(self, q, kv_lens, block_tables, cu_q_lens, num_seqs, n, most, k_cache):
        """`most`: chunks a slice at most, None for this host's choice (`host_slice_chunks`)."""
        t, hq, d = q.shape
        _, bs, hkv, _ = k_cache.shape
        max_seqs, max_blocks = block_tables.shape
        per_chunk = chunk_blocks(bs)
        keys = per_chunk * bs
        self.slices, self.per_slice = slicing(n, most or host_slice_chunks(k_cache))
        present = jnp.arange(max_seqs) < num_seqs
        q_lens = jnp.where(present, cu_q_lens[1:] - cu_q_lens[:-1], 0)
        lens = jnp.where(present, kv_lens, 0)
        slots = self.slices * self.per_slice
        self.seq, chunk, self.live, count = lay_out((lens + keys - 1) // keys, slots)
        cols = chunk[:, None] * per_chunk + jnp.arange(per_chunk)[None, :]
        self.blocks = block_tables[self.seq[:, None], jnp.minimum(cols, max_blocks - 1)]  # [N, P]
        self.q_seq = q[jnp.clip(cu_q_lens[:-1], 0, t - 1)].astype(jnp.float32)  # [S, Hq, D]
        self.k_pos = chunk[:, None] * keys + jnp.arange(keys)[None, :]  # [N, L]
        self.kv_len = lens[self.seq][:, None]
        self.hkv, self.max_seqs, self.t, self.dtype = hkv, max_seqs, t, q.dtype
        self.rounding = rounding.for_pieces(
            q.dtype, self.k_pos, self.seq, max_seqs, max_blocks * bs
        )
        self.dest = jnp.where(present & (q_lens > 0), cu_q_lens[:-1], t)
        self.broken = jnp.any(q_lens > 1) | (count > n)

    def sliced(self, x):
        """[N, ...] -> [slices, per_slice, ...], for lax.map."""
        return x.reshape(self.slices, self.per_slice, *x.shape[1:])

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
    s = masked_scores(s, mask, sm_scale, soft_cap)
    if rounded is not None:
        return rounded.parts(s, mask)
    return masked_parts(s, mask)


def masked_scores(s, mask, sm_scale, soft_cap):
    """Scores scaled (and soft-capped), -inf where mask is false."""
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return jnp.where(mask, s, -jnp.inf)


def masked_parts(s, mask):
    """(p, max, sum) of `masked_scores`, in f32."""
    m = jnp.max(s, axis=-1)  # -inf for a chunk with nothing attended
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]), 0.0)
    return p, m, jnp.sum(p, axis=-1)


def _product(step, k_cache, v_cache, *, exact, sm_scale, sliding_window, soft_cap, narrow_dots):
    """Scores, softmax parts and value product of every chunk: (o [N, Hq, D], m, sum [N, Hq]).
    The keys and the values are gathered a slice at a time (module docstring); the scores of all
    chunks (Hq / (Hkv * D) the size of their keys) are kept whole between the two passes, so a
    bf16 step's rounding sees every chunk of a sequence. `exact`: a slice whose own-head output is
    not all finite is redone by `reference.product_of_finite_values` (otherwise the fast product
    alone). `narrow_dots`: see `dot_dtypes` (the value dot; the scores are a multiply-reduce)."""
    _, bs, hkv, d = k_cache.shape
    value_dtype = dot_dtypes(step.dtype, step.rounding, narrow_dots)[1]
    hq = step.q_seq.shape[1]
    g, length = hq // hkv, chunk_blocks(bs) * bs

    def scores(piece):
        blocks, seq = piece
        n = blocks.shape[0]
        k = gather_rows(k_cache, blocks).astype(jnp.float32).reshape(n, length, hkv, 1, d)
        s = jnp.sum(step.q_seq[seq].reshape(n, 1, hkv, g, d) * k, axis=-1)  # [n, L, Hkv, G]
        return jnp.moveaxis(s.reshape(n, length, hq), 1, 2)

    s = jax.lax.map(scores, (step.sliced(step.blocks), step.sliced(step.seq)))
    s = s.reshape(-1, hq, length)
    mask = step.mask(sliding_window)  # the same keys for every head
    p, m, total = softmax_parts(s, mask[:, None, :], sm_scale, soft_cap, step.rounding)

    def values(piece):
        blocks, p, mask, live = piece
        v = gather_rows(v_cache, blocks).astype(value_dtype)  # [n, L, Hkv * D]
        o = jnp.einsum(
            "nql,nle->nqe",
            p.astype(value_dtype),
            v,
            precision=reference._precision(),
            preferred_element_type=jnp.float32,
        )
        o = _own_heads(o, hkv)
        if not exact:
            return o
        finite = jnp.all(jnp.isfinite(o) | ~live[:, None, None]) | step.broken

        def finite_values_only(v):  # each chunk as a tile of one query
            n = v.shape[0]
            wide = v.reshape(n, length, hkv, d).astype(jnp.float32)
            pieces = (p.reshape(n, hkv, g, 1, length), wide, mask[:, None])
            return reference.product_of_finite_values(*pieces).reshape(n, hq, d)

        return jax.lax.cond(finite, lambda v: o, finite_values_only, v)

    pieces = (step.blocks, p, mask, step.live)
    o = jax.lax.map(values, tuple(step.sliced(x) for x in pieces))
    return o.reshape(-1, hq, d), m, total
