"""Random ragged paged-attention batches and a per-token numpy oracle, shared by the kernel tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def make_batch(
    rng,
    q_lens,
    kv_lens,
    *,
    hq,
    hkv,
    d,
    block_size,
    max_blocks,
    pad_tokens=0,
    pad_seqs=0,
    num_blocks=None,
    dtype=np.float32,
    poison=True,
    unused_entry=None,
):
    """A batch whose pages are a random permutation of the pool; unused pages, the unused tail of
    each last page and padding query rows are NaN when `poison`, so reading them shows up. Table
    entries past a sequence's pages hold `unused_entry` (default: a poisoned page; -1 as an engine
    may pad)."""
    q_lens = list(q_lens)
    kv_lens = list(kv_lens)
    n = len(q_lens)
    s = n + pad_seqs
    need = [-(-k // block_size) for k in kv_lens]
    if num_blocks is None:
        num_blocks = sum(need) + 3
    t = sum(q_lens) + pad_tokens
    perm = rng.permutation(num_blocks)
    tables = np.zeros((s, max_blocks), np.int32)
    k_cache = rng.standard_normal((num_blocks, block_size, hkv, d)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, block_size, hkv, d)).astype(np.float32)
    used = np.zeros((num_blocks, block_size), bool)
    pos = 0
    for i, (nb, kl) in enumerate(zip(need, kv_lens, strict=True)):
        blocks = perm[pos : pos + nb]
        pos += nb
        tables[i, :nb] = blocks
        tables[i, nb:] = perm[-1] if unused_entry is None else unused_entry
        for j, b in enumerate(blocks):
            used[b, : min(block_size, kl - j * block_size)] = True
    tables[n:] = perm[-1]
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    if poison:
        k_cache[~used] = np.nan
        v_cache[~used] = np.nan
        q[sum(q_lens) :] = np.nan
    cu = np.zeros(s + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    kvl = np.zeros(s, np.int32)
    kvl[:n] = kv_lens
    return dict(
        q=q.astype(dtype),
        k_cache=k_cache.astype(dtype),
        v_cache=v_cache.astype(dtype),
        kv_lens=kvl,
        block_tables=tables,
        cu_q_lens=cu,
        num_seqs=np.int32(n),
    )


def numpy_attention(b, *, sm_scale, sliding_window=None, soft_cap=None):
    """One query token and one head at a time, straight from the definition."""
    q = np.asarray(b["q"], np.float64)
    kc = np.asarray(b["k_cache"], np.float64)
    vc = np.asarray(b["v_cache"], np.float64)
    t, hq, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    g = hq // hkv
    out = np.zeros((t, hq, d))
    cu = b["cu_q_lens"]
    for s in range(int(b["num_seqs"])):
        kl = int(b["kv_lens"][s])
        ql = int(cu[s + 1] - cu[s])
        for i in range(ql):
            tok = int(cu[s]) + i
            qpos = kl - ql + i
            keys = [
                p for p in range(qpos + 1) if sliding_window is None or qpos - p < sliding_window
            ]
            for h in range(hq):
                ks = np.stack([kc[b["block_tables"][s, p // bs], p % bs, h // g] for p in keys])
                vs = np.stack([vc[b["block_tables"][s, p // bs], p % bs, h // g] for p in keys])
                sc = ks @ q[tok, h] * sm_scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                w = np.exp(sc - sc.max())
                out[tok, h] = (w / w.sum()) @ vs
    return out


def case_batch(rng, q_lens, kv_lens, hq, hkv, d, bs, pad_seqs, pad_tokens, poison=True):
    """`make_batch` from a test case's fields, each table two blocks wider than its longest row."""
    return make_batch(
        rng,
        q_lens,
        kv_lens,
        hq=hq,
        hkv=hkv,
        d=d,
        block_size=bs,
        max_blocks=-(-max(kv_lens) // bs) + 2,
        pad_seqs=pad_seqs,
        pad_tokens=pad_tokens,
        poison=poison,
    )


def as_jnp(b):
    """A numpy batch's arrays as jax arrays."""
    return {k: jnp.asarray(v) for k, v in b.items()}
