"""bf16 paged attention on the jnp path against torch's CPU sdpa in bf16 (what HF's bf16 models
attend with): the probabilities rounded where torch's flash kernel rounds them
(pallas_kernels/ragged_paged_attention/rounding.py) leave a few percent of the outputs one bf16 ulp
away (torch's approximate exponential), where f32-normalised probabilities left ~20%."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pallas_kernels.ragged_paged_attention import decode, reference, tiles

BS, HQ, HKV, D = 16, 8, 2, 16


def _case(seed, q_len, kv_len):
    """bf16 q [q_len, HQ, D], k, v [kv_len, HKV, D] and a one-sequence paged step over them."""
    rng = np.random.default_rng(seed)

    def bf16(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32).astype(jnp.bfloat16)

    q, k, v = bf16(q_len, HQ, D, scale=2.0), bf16(kv_len, HKV, D, scale=2.0), bf16(kv_len, HKV, D)
    blocks = -(-kv_len // BS)
    pad = blocks * BS - kv_len

    def cache(x):  # f32, as the jnp path keeps a bf16 model's caches on the CPU; block 0 unused
        paged = jnp.pad(x.astype(jnp.float32), ((0, pad), (0, 0), (0, 0)))
        return jnp.concatenate([jnp.zeros((1, BS, HKV, D)), paged.reshape(blocks, BS, HKV, D)])

    step = (
        q,
        cache(k),
        cache(v),
        jnp.asarray([kv_len], jnp.int32),
        jnp.arange(1, blocks + 1, dtype=jnp.int32)[None, :],
        jnp.asarray([0, q_len], jnp.int32),
        jnp.int32(1),
    )
    return step, (q, k, v)


def _torch(q, k, v, causal):
    """torch sdpa in bf16 ([T, H, D] in and out), GQA as HF passes it."""
    tq, tk, tv = (torch.from_numpy(np.asarray(x.astype(jnp.float32))).bfloat16() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        tq.transpose(0, 1)[None],
        tk.transpose(0, 1)[None],
        tv.transpose(0, 1)[None],
        is_causal=causal,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).float().numpy()


def _mismatch(ours, want):
    return float(np.mean(np.asarray(ours.astype(jnp.float32)) != want))


@pytest.mark.parametrize("q_len, kv_len", [(335, 335), (1, 700)])
def test_bf16_attention_rounds_where_torch_sdpa_rounds(q_len, kv_len):
    """A 335-token causal prefill (11 query tiles) and one decode query over 700 keys (two of
    torch's 512-key blocks: the running maximum changes between them)."""
    step, (q, k, v) = _case(q_len + kv_len, q_len, kv_len)
    want = _torch(q, k, v, causal=q_len > 1)
    ref = jax.jit(lambda *a: reference.ragged_paged_attention(*a, sm_scale=D**-0.5))
    f32 = jax.jit(
        lambda *a: reference.ragged_paged_attention(*a, sm_scale=D**-0.5, round_probabilities=False)
    )
    if q_len > 1:
        pairs = tiles.tile_chunks([(q_len, kv_len)], BS)
        path = functools.partial(tiles.ragged_paged_tiles, num_pairs=pairs, sm_scale=D**-0.5)
    else:
        chunks = decode.live_chunks([kv_len], BS)
        path = functools.partial(decode.ragged_paged_decode, num_chunks=chunks, sm_scale=D**-0.5)
    fast = jax.jit(path)
    narrow = jax.jit(functools.partial(path, narrow_dots=True))  # bf16 dot operands
    unrounded = _mismatch(f32(*step), want)
    assert unrounded > 0.1, unrounded  # the scenario: f32-normalised probabilities
    for name, fn in (("reference", ref), ("fast path", fast), ("narrow dots", narrow)):
        assert _mismatch(fn(*step), want) < 0.05, (name, _mismatch(fn(*step), want), unrounded)
