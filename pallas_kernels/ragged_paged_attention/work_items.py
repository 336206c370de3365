"""Cutting a flat ragged token batch into work items: runs of at most `chunk` tokens of one sequence.

Both the reference and the kernel iterate over these items; the item count is a static function of
the shapes so it can size a grid, and unused items are marked by holding 0 tokens.
"""

from __future__ import annotations

import jax.numpy as jnp


def pow2_ceil(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def pow2_floor(n: int) -> int:
    return 1 << max(0, max(n, 1).bit_length() - 1)


def work_item_count(num_tokens: int, max_seqs: int, chunk: int) -> int:
    """Upper bound on the items a batch of `num_tokens` tokens over `max_seqs` sequences makes.

    Every item holds at least one token, and a sequence wastes at most one partial item.
    """
    return max(1, min(-(-num_tokens // chunk) + max_seqs, num_tokens))


def work_items(cu_q_lens, num_seqs, num_tokens: int, chunk: int):
    """Per item: (sequence, first token, number of tokens), each int32[W]."""
    max_seqs = cu_q_lens.shape[0] - 1
    w = work_item_count(num_tokens, max_seqs, chunk)
    present = jnp.arange(max_seqs) < num_seqs
    q_lens = jnp.where(present, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    n_items = (q_lens + chunk - 1) // chunk
    ends = jnp.cumsum(n_items)
    ids = jnp.arange(w, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, ids, side="right"), max_seqs - 1).astype(jnp.int32)
    first_item = ends[seq] - n_items[seq]
    start = cu_q_lens[seq] + (ids - first_item) * chunk
    ntok = jnp.where(ids < ends[-1], jnp.minimum(chunk, cu_q_lens[seq + 1] - start), 0)
    return seq, start.astype(jnp.int32), ntok.astype(jnp.int32)


def query_positions(seq, start, kv_lens, cu_q_lens):
    """Context position of each item's first token: a sequence's tokens end its context."""
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    return (kv_lens[seq] - q_len + (start - cu_q_lens[seq])).astype(jnp.int32)
