"""DeepSeek-V3.2's sparse MLA (DSA): MLA attention over the positions the lightning indexer picks.

Each token attends only to the top-`index_topk` positions of its causal context by index score
(model/layers/dsa_indexer.py); a context no longer than index_topk is attended whole, so there the
layer computes dense MLA. The attention runs in MLA's absorbed form against the latent pool
(model/layers/mla.py) through `sparse_mla_decode`, split by token:

- decode tokens (a sequence's only scheduled token this step) go through the implementation chosen
  when the model was built (`choose_decode_backend`: the Pallas kernel on GPUs, the jnp reference
  on the CPU, Pallas in interpret mode when forced);
- prefill-chunk tokens go through the masked reference path: the op's jnp reference, which scores
  each token's gathered rows and masks every unselected or non-causal one with -inf (HF's additive
  top-k mask, over the selected rows only). It runs only in steps that hold a prefill chunk.

Each path sees the other's tokens with a top-k length of 0, so the kernel skips them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.base import ModelOptions
from model.batch import ModelBatch
from model.config import ModelConfig
from model.layers.dsa_indexer import Indexer
from model.layers.mla import (
    MLAShape,
    MLAttention,
    selected_slots,
    token_sequences,
    write_latent,
)
from pallas_kernels import backends
from pallas_kernels.sparse_mla_decode import OP, reference, sparse_mla_decode


def indexer_shape(config: ModelConfig) -> tuple[int, int, int]:
    """(index_n_heads, index_head_dim, index_topk) of a V3.2 checkpoint; raises ValueError naming
    the field when the checkpoint cannot have an indexer."""
    hf = config.hf_config
    if hf.get("q_lora_rank") is None:
        raise ValueError(
            f"{config.path}: DeepSeek-V3.2's indexer reads the compressed query, so q_lora_rank "
            "must be set, got None"
        )
    out = []
    for key in ("index_n_heads", "index_head_dim", "index_topk"):
        v = hf.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(
                f"{config.path}: DSA config field {key!r} must be a positive int, got {v!r}"
            )
        out.append(v)
    return tuple(out)


def choose_decode_backend(config: ModelConfig, options: ModelOptions) -> backends.Choice:
    """The sparse_mla_decode implementation for decode tokens (one decision, logged);
    `options.attention_backend` forces one ("pallas" on the CPU runs in interpret mode)."""
    shape = MLAShape.from_config(config)
    return backends.select(
        OP,
        impl=options.attention_backend,
        dtype=options.resolve_cache_dtype(config),
        head_dim=shape.latent_dim,
        features={"topk_lengths"},
        d_v=shape.kv_lora_rank,
    )


class SparseMLAttention(MLAttention):
    """MLA with DeepSeek-V3.2's indexer; parameter names follow HF's DeepseekV32Attention."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype, *, decode_backend):
        num_heads, head_dim, topk = indexer_shape(config)
        super().__init__(config, layer_idx, dtype, backend=None, sparse_backend=decode_backend)
        self.indexer = Indexer(
            hidden_size=config.hidden_size,
            q_lora_rank=self.shape.q_lora_rank,
            num_heads=num_heads,
            head_dim=head_dim,
            rope_dim=self.shape.qk_rope_head_dim,
            topk=topk,
            dtype=dtype,
        )

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        latent_cache: tuple[jax.Array],
        key_cache: tuple[jax.Array],
        batch: ModelBatch,
    ) -> tuple[jax.Array, tuple[jax.Array], tuple[jax.Array]]:
        """x [T, hidden] (after input_layernorm) -> (out [T, hidden], latent_cache, key_cache)."""
        q_resid = self.q_resid(x)
        selected, key_cache = self.indexer(x, q_resid, cos, sin, key_cache, batch)
        (cache,) = latent_cache
        q_lat, q_pe = self.project_q(x, cos, sin, q_resid)
        cache = write_latent(cache, self.project_latent(x, cos, sin), batch.slot_mapping)
        out = self.attend(q_lat, q_pe, cache, batch, selected)
        return self.output(out), (cache,), key_cache

    def attend(self, q_lat, q_pe, cache, batch: ModelBatch, selected=None) -> jax.Array:
        """Attention in latent space [T, H, kv_lora_rank] over each token's selected positions."""
        if selected is None:
            raise ValueError(f"layer {self.layer_idx}: DSA attention needs the indexer's positions")
        if self.sparse_backend.impl == "reference":  # one path serves every token
            return super().attend(q_lat, q_pe, cache, batch, selected)
        r = self.shape.kv_lora_rank
        q = jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1).astype(cache.dtype)
        nb, bs, _, d = cache.shape
        rows = cache.reshape(nb * bs, d)
        slots = selected_slots(selected.astype(jnp.int32), batch, bs)
        topk = jnp.int32(slots.shape[1])
        kw = dict(sm_scale=self.scale, d_v=r)
        decode, real = decode_tokens(batch)
        out, _ = sparse_mla_decode(
            q, rows, slots, topk_lengths=jnp.where(decode, topk, 0), impl=self.sparse_backend, **kw
        )

        def prefill(_):
            lengths = jnp.where(decode, 0, topk)
            return reference.sparse_mla_decode(q, rows, slots, topk_lengths=lengths, **kw)[0]

        chunk = jax.lax.cond(
            jnp.any(real & ~decode), prefill, lambda _: jnp.zeros_like(out), operand=None
        )
        return jnp.where(decode[:, None, None], out, chunk).astype(q_lat.dtype)


def decode_tokens(batch: ModelBatch) -> tuple[jax.Array, jax.Array]:
    """(bool [T] tokens that are their sequence's only token this step, bool [T] real tokens)."""
    t = jnp.arange(batch.token_ids.shape[0], dtype=jnp.int32)
    real = t < batch.cu_q_lens[batch.num_seqs]
    seq = token_sequences(batch)
    q_lens = batch.cu_q_lens[seq + 1] - batch.cu_q_lens[seq]
    return real & (q_lens == 1), real
