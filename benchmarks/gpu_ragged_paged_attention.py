"""GPU benchmark cases for ragged paged attention: decode-heavy, prefill-heavy and mixed batches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu_common import Case
from pallas_kernels.ragged_paged_attention import kernel, reference

OP = "ragged_paged_attention"


def _inputs(key, *, q_lens, kv_lens, hq, hkv, d, block_size, max_blocks, pad_seqs, dtype):
    """A batch over a shuffled page pool (random values everywhere, so stale pages are not zero)."""
    rng = np.random.default_rng(int(jax.random.key_data(key).ravel()[-1]))
    n = len(q_lens)
    need = [-(-k // block_size) for k in kv_lens]
    num_blocks = sum(need) + 1
    perm = rng.permutation(num_blocks)
    tables = np.full((n + pad_seqs, max_blocks), perm[-1], np.int32)
    pos = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[pos : pos + nb]
        pos += nb
    cu = np.zeros(n + pad_seqs + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    kvl = np.zeros(n + pad_seqs, np.int32)
    kvl[:n] = kv_lens
    kq, kk, kv = jax.random.split(key, 3)
    cache = (num_blocks, block_size, hkv, d)
    return (
        jax.random.normal(kq, (int(cu[-1]), hq, d), dtype),
        jax.random.normal(kk, cache, dtype),
        jax.random.normal(kv, cache, dtype),
        jnp.asarray(kvl),
        jnp.asarray(tables),
        jnp.asarray(cu),
        jnp.int32(n),
    )


def _case(
    name,
    *,
    q_lens,
    kv_lens,
    hq=32,
    hkv=8,
    d=128,
    block_size=16,
    pad_seqs=0,
    dtype=jnp.bfloat16,
    smoke=False,
    **attn,
):
    max_blocks = -(-max(kv_lens) // block_size)
    attn = dict(sm_scale=d**-0.5, **attn)
    make = functools.partial(
        _inputs,
        q_lens=q_lens,
        kv_lens=kv_lens,
        hq=hq,
        hkv=hkv,
        d=d,
        block_size=block_size,
        max_blocks=max_blocks,
        pad_seqs=pad_seqs,
        dtype=dtype,
    )
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    return Case(
        op=OP,
        name=name,
        make_inputs=make,
        pallas=lambda interpret: functools.partial(
            kernel.ragged_paged_attention, interpret=interpret, **attn
        ),
        reference=lambda: functools.partial(reference.ragged_paged_attention, **attn),
        atol=tol,
        rtol=tol,
        smoke=smoke,
    )


def cases() -> list[Case]:
    rng = np.random.default_rng(0)
    decode_ctx = [int(x) for x in rng.integers(256, 2048, 256)]
    few_ctx = [int(x) for x in rng.integers(4096, 8192, 4)]
    mixed_ctx = [int(x) for x in rng.integers(128, 1024, 62)] + [900, 1500]
    return [
        _case("decode s256 ctx<2k hq32/8 d128", q_lens=[1] * 256, kv_lens=decode_ctx),
        _case("decode s4 ctx<8k hq32/8 d128 (split-kv)", q_lens=[1] * 4, kv_lens=few_ctx),
        _case(
            "prefill 4x512 ctx 1k-2k hq32/8 d128", q_lens=[512] * 4, kv_lens=[512, 1024, 1536, 2048]
        ),
        _case(
            "mixed 62 dec + 2x256 pre, window 512",
            q_lens=[1] * 62 + [256, 256],
            kv_lens=mixed_ctx,
            sliding_window=512,
            soft_cap=30.0,
        ),
        _case(
            "smoke mixed f32",
            q_lens=[1, 7, 16],
            kv_lens=[20, 7, 40],
            hq=4,
            hkv=2,
            d=16,
            pad_seqs=1,
            dtype=jnp.float32,
            smoke=True,
        ),
        _case(
            "smoke decode bf16 window",
            q_lens=[1, 1, 1],
            kv_lens=[5, 33, 60],
            hq=8,
            hkv=1,
            d=32,
            block_size=8,
            sliding_window=16,
            smoke=True,
        ),
    ]
