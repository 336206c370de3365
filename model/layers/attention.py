"""Grouped-query self-attention over a ragged token batch and a paged KV cache.

q, k and v come from one fused projection; this step's keys and values are written into the cache
through the slot mapping first, so every query attends over its sequence's whole context (cached
pages plus this step's tokens) through the block tables.

The layer takes its kernel choice when it is built (`choose_backend`, decided once per model by
`pallas_kernels.backends`) and passes it to the dispatcher, which only confirms it.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from model.batch import ModelBatch
from model.layers import compute
from model.layers.linear import Linear
from model.layers.norms import RMSNorm
from model.layers.rotary import apply_rotary
from model.sharding import GROUP, group_size, on_each_device, split_fused
from pallas_kernels.backends import Choice
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, select, write_kv


def choose_backend(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    cache_dtype,
    block_size: int,
    sliding_window: int | None,
    impl: str,
    prefix_lm: bool = False,
) -> Choice:
    """The paged-attention implementation for layers of these shapes (one decision, logged).

    Described by shapes alone, so it is made before any array exists; `sliding_window` is any
    window the layers use (None when none does), as the implementation must serve every layer;
    `prefix_lm` says the layers pass a bidirectional prefix length per sequence (PaliGemma).
    """
    q = jax.ShapeDtypeStruct((1, num_heads, head_dim), dtype)
    k_cache = jax.ShapeDtypeStruct((1, block_size, num_kv_heads, head_dim), cache_dtype)
    return select(q, k_cache, sliding_window=sliding_window, prefix_lm=prefix_lm, impl=impl)


class Attention(nnx.Module):
    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_eps: float | None,
        sliding_window: int | None,
        backend: Choice,
        dtype,
    ):
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv_proj = Linear(
            hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias=qkv_bias, dtype=dtype
        )
        self.o_proj = Linear(num_heads * head_dim, hidden, bias=o_bias, dtype=dtype)
        # Qwen3 normalises q and k per head, before the rotary embedding.
        if qk_norm_eps is None:
            self.q_norm = self.k_norm = None
        else:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype)
        self.sliding_window = sliding_window

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        kv_cache: tuple[jax.Array, jax.Array],
        batch: ModelBatch,
        prefix_lens: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """`prefix_lens` int32[S]: each sequence's first prefix_lens[s] positions attend both
        ways (a prefix LM); None: causal."""
        t = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        # Under tensor parallelism the fused columns are laid out per device (model/sharding.py).
        q, k, v = split_fused(self.qkv_proj(x), (hq * d, hkv * d, hkv * d), group_size())
        q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        heads, pages = P(None, GROUP, None), P(None, None, GROUP, None)
        attend = on_each_device(
            functools.partial(
                _attend, sm_scale=d**-0.5, sliding_window=self.sliding_window, impl=self.backend
            ),
            in_specs=(heads, heads, heads, pages, pages, P(), P()),
            out_specs=(heads, pages, pages),
        )
        out, k_cache, v_cache = attend(q, k, v, *kv_cache, batch, prefix_lens)
        return self.o_proj(out.reshape(t, hq * d)), (k_cache, v_cache)


def _attend(
    q, k, v, k_cache, v_cache, batch: ModelBatch, prefix_lens, *, sm_scale, sliding_window, impl
):
    """The cache write and the attention kernel; per device, on its own heads, under tensor
    parallelism (a Pallas kernel cannot be partitioned by XLA)."""
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
    out = ragged_paged_attention(
        q,
        k_cache,
        v_cache,
        batch.kv_lens,
        batch.block_tables,
        batch.cu_q_lens,
        batch.num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        prefix_lens=prefix_lens,
        decode_chunks=batch.decode_chunks,
        tile_chunks=batch.tile_chunks,
        narrow_dots=compute.narrow_attention_dots(q.dtype),
        impl=impl,
    )
    return out, k_cache, v_cache
