"""DeepSeek-V3.2's lightning indexer (DSA): per query token, the top-`index_topk` positions of its
causal context that sparse MLA attends to.

It computes what HF's `DeepseekV32Indexer` computes (kernels.md B.2 without the Hadamard rotation
and the FP8 quantisation, which HF skips):
    q = wq_b(q_latent) [T, H, D],  k = LayerNorm(wk(x)) [T, D]   (D = index_head_dim)
    both split [rope | nope] with rope = qk_rope_head_dim, the rope part rotated NeoX-style
    (half-split, unlike MLA's interleaved rope), with the same cos/sin as the attention;
    score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]),  w = weights_proj(x) * D^-0.5 * H^-0.5
(HF applies D^-0.5 inside the ReLU; a positive factor commutes with it, so it is folded into w.)

The keys live in their own paged pool ("DSA indexer keys", one shared head of D per token) under
the request's block table, written through the batch's slot mapping like the attention cache, so
keys computed in earlier steps, or found by a prefix-cache hit, score like this step's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.batch import ModelBatch
from model.layers.linear import Linear
from model.layers.mla import token_sequences
from model.layers.rotary import apply_rotary
from pallas_kernels.bitcast import from_bits, to_bits
from pallas_kernels.paged_write import write_rows
from pallas_kernels.sparse_mla_decode import indexer_topk

# Query tokens scored together when picking top-k: bounds the gathered context keys to
# TOKENS_PER_MAP x context x D at a time, whatever the step's token count.
TOKENS_PER_MAP = 16


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm (weight and bias): normalised in f32, rounded once to x's dtype."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class Indexer(nnx.Module):
    def __init__(
        self,
        *,
        hidden_size: int,
        q_lora_rank: int,
        num_heads: int,
        head_dim: int,
        rope_dim: int,
        topk: int,
        dtype,
    ):
        if not 0 < rope_dim <= head_dim or rope_dim % 2:
            raise ValueError(
                f"index_head_dim ({head_dim}) must hold the even rope part qk_rope_head_dim "
                f"({rope_dim})"
            )
        self.num_heads, self.head_dim, self.rope_dim, self.topk = (
            num_heads,
            head_dim,
            rope_dim,
            topk,
        )
        self.wq_b = Linear(q_lora_rank, num_heads * head_dim, bias=False, dtype=dtype)
        self.wk = Linear(hidden_size, head_dim, bias=False, dtype=dtype)
        self.k_norm = LayerNorm(head_dim, 1e-6, dtype)
        # HF keeps weights_proj in f32 whatever the model's dtype (_keep_in_fp32_modules).
        self.weights_proj = Linear(hidden_size, num_heads, bias=False, dtype=jnp.float32)

    def _rope(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        r = self.rope_dim
        return jnp.concatenate([apply_rotary(x[..., :r], cos, sin), x[..., r:]], axis=-1)

    def keys(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """[T, D]: each token's key, as the pool keeps it."""
        return self._rope(self.k_norm(self.wk(x))[:, None, :], cos, sin)[:, 0, :]

    def queries(self, q_latent: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """[T, H, D] from MLA's normalised q latent (q_a_layernorm(q_a_proj(x)))."""
        q = self.wq_b(q_latent).reshape(q_latent.shape[0], self.num_heads, self.head_dim)
        return self._rope(q, cos, sin)

    def head_weights(self, x: jax.Array) -> jax.Array:
        """f32 [T, H]: each head's weight, with HF's D^-0.5 and H^-0.5 folded in."""
        w = self.weights_proj(x.astype(jnp.float32))
        return w * (self.head_dim**-0.5 * self.num_heads**-0.5)

    def __call__(
        self,
        x: jax.Array,
        q_latent: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        key_cache: tuple[jax.Array],
        batch: ModelBatch,
    ) -> tuple[jax.Array, tuple[jax.Array]]:
        """(selected int32 [T, topk] absolute positions, -1 padded; the key cache with this
        step's keys written)."""
        (cache,) = key_cache
        cache = write_rows(cache, self.keys(x, cos, sin)[:, None, :], batch.slot_mapping)
        selected = select_topk(
            self.queries(q_latent, cos, sin), self.head_weights(x), cache, batch, self.topk
        )
        return selected, (cache,)


def context_pages(cache: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[S, max_blocks * block_size, D]: each sequence's cached rows in position order."""
    s, mb = block_tables.shape
    rows = from_bits(to_bits(cache)[block_tables], cache.dtype)  # [S, MB, BS, 1, D]
    return rows.reshape(s, mb * cache.shape[1], cache.shape[-1])


def select_topk(
    q: jax.Array, weights: jax.Array, cache: jax.Array, batch: ModelBatch, topk: int
) -> jax.Array:
    """int32 [T, topk]: for each token, the positions p' <= p of its sequence with the highest index
    scores (ties to the lower position), -1 padded when the context is shorter than topk."""

    def scored(_):
        keys = context_pages(cache, batch.block_tables)

        def one(args):
            q_t, w_t, seq, pos = args
            return indexer_topk(q_t[None], keys[seq], w_t[None], topk, pos[None] + 1)[0]

        xs = (q, weights, token_sequences(batch), batch.positions)
        return jax.lax.map(one, xs, batch_size=TOKENS_PER_MAP)

    def whole(_):
        p = jnp.arange(topk, dtype=jnp.int32)[None, :]
        return jnp.where(p <= batch.positions[:, None], p, -1)

    # When no token of the step has more than topk positions, each takes its whole context: skip
    # the scores and the top-k (XLA:CPU's top_k alone costs ~0.1 ms per token at 1k positions).
    return jax.lax.cond(jnp.max(batch.positions) < topk, whole, scored, operand=None)
