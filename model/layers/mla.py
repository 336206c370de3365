"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a ragged batch and a paged latent cache.

Each token keeps one shared "head" per layer: the normalised KV latent c (kv_lora_rank) followed by
its roped positional key k_pe (qk_rope_head_dim), one row of the "MLA latent" pool. Attention runs
in the absorbed form for every token, prefill and decode alike: q_nope goes through W_UK (the key
half of kv_b_proj) into latent space, so a query is [q_nope W_UK | q_pe] against the latent rows
[c | k_pe] (multi-query attention with one KV head of kv_lora_rank + rope channels), and the values
are c itself, brought out through W_UV (the value half of kv_b_proj). That is HF's expanded
computation regrouped (q.k_nope = (q W_UK).c and p.(c W_UV) = (p.c) W_UV), so one path serves
chunked prefill, prefix hits and decode against the same cache.

Dense causal attention goes through `ragged_paged_attention` with the latent pool as both keys and
values (the rope channels of its output are dropped). DeepSeek-V3.2's indexer instead hands each
token the positions it may attend to (`selected`), served by `sparse_mla_decode` over the same pool.

RoPE: HF's DeepSeek rotates q_pe and k_pe in interleaved pairs (x0, x1), (x2, x3), ... and returns
them de-interleaved ([rotated evens | rotated odds]); `rope_interleave: false` uses the half-split
layout. Both sides of every dot product share the layout, and the cache holds HF's output layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from model.batch import ModelBatch
from model.config import ConfigError, ModelConfig, RopeConfig
from model.layers import compute
from model.layers.linear import Linear
from model.layers.norms import RMSNorm
from model.layers.rotary import apply_rotary
from model.sharding import GROUP, on_each_device
from pallas_kernels.backends import Choice
from pallas_kernels.paged_write import write_rows
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, select
from pallas_kernels.sparse_mla_decode import sparse_mla_decode

# HF's DeepseekV3RMSNorm default: q_a_layernorm and kv_a_layernorm do not take rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True, slots=True)
class MLAShape:
    """The MLA sizes of a DeepSeek checkpoint, read from its config.json."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    attention_bias: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """One cached row: the latent c, then k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_config(cls, config: ModelConfig) -> MLAShape:
        hf = config.hf_config
        q_lora = hf.get("q_lora_rank")
        shape = cls(
            num_heads=config.num_attention_heads,
            q_lora_rank=None if q_lora is None else _positive(hf, "q_lora_rank", config),
            kv_lora_rank=_positive(hf, "kv_lora_rank", config),
            qk_nope_head_dim=_positive(hf, "qk_nope_head_dim", config),
            qk_rope_head_dim=_positive(hf, "qk_rope_head_dim", config),
            v_head_dim=_positive(hf, "v_head_dim", config),
            rope_interleave=bool(hf.get("rope_interleave", True)),
            attention_bias=config.attention_bias,
        )
        if shape.qk_rope_head_dim % 2:
            raise ConfigError(
                f"{config.path}: MLA config field 'qk_rope_head_dim' must be even, got "
                f"{shape.qk_rope_head_dim}"
            )
        return shape


def _positive(hf, key: str, config: ModelConfig) -> int:
    v = hf.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(
            f"{config.path}: MLA config field {key!r} must be a positive int, got {v!r}"
        )
    return v


def mla_rope(config: ModelConfig) -> RopeConfig:
    """The checkpoint's rope over the qk_rope_head_dim channels (old DeepSeek configs have no
    head_dim, and ModelConfig's hidden / heads means nothing for MLA)."""
    return dataclasses.replace(config.rope, head_dim=MLAShape.from_config(config).qk_rope_head_dim)


def softmax_scale(config: ModelConfig) -> float:
    """HF's `yarn_apply_mscale`: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) squared
    when the rope is scaled and mscale_all_dim is set (YaRN's attention temperature)."""
    shape = MLAShape.from_config(config)
    scale = shape.qk_head_dim**-0.5
    rope = config.rope
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = 1.0 if rope.factor <= 1 else 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale = scale * m * m
    return scale


def choose_backend(config: ModelConfig, *, cache_dtype, block_size: int, impl: str) -> Choice:
    """The paged-attention implementation for the absorbed (MQA, one latent head) layers."""
    shape = MLAShape.from_config(config)
    q = jax.ShapeDtypeStruct((1, shape.num_heads, shape.latent_dim), config.jnp_dtype)
    cache = jax.ShapeDtypeStruct((1, block_size, 1, shape.latent_dim), jnp.dtype(cache_dtype))
    return select(q, cache, impl=impl)


def rotate_pe(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """x [T, H, P] rotated by cos, sin [T, P / 2] in HF DeepSeek's layout (see the module doc)."""
    if interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rotary(x, cos, sin)


def write_latent(cache: jax.Array, latent: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter latent rows [T, D] into the pool [num_blocks, block_size, 1, D]; slot -1 skipped.
    (On the pool's own shape: a flat reshape copied the whole pool every step on XLA:CPU.)"""
    return write_rows(cache, latent[:, None, :], slot_mapping)


def token_sequences(batch: ModelBatch) -> jax.Array:
    """int32 [T]: the batch row of each token's sequence (padding tokens get the last row)."""
    t = batch.token_ids.shape[0]
    s = batch.block_tables.shape[0]
    seq = jnp.searchsorted(batch.cu_q_lens[1:], jnp.arange(t, dtype=jnp.int32), side="right")
    return jnp.minimum(seq, s - 1).astype(jnp.int32)


def selected_slots(selected: jax.Array, batch: ModelBatch, block_size: int) -> jax.Array:
    """Absolute token positions [T, K] (-1 none) -> cache slots [T, K] (-1 none) through each
    token's block table. A position after the token's own is causal-masked to -1 too, so an indexer
    that pads its top-k with positions it did not score never reaches a future or stale row."""
    seq = token_sequences(batch)
    tables = batch.block_tables[seq]  # [T, MB]
    max_blocks = tables.shape[1]
    ok = (selected >= 0) & (selected <= batch.positions[:, None])
    pos = jnp.where(ok, selected, 0)
    block = jnp.take_along_axis(tables, jnp.minimum(pos // block_size, max_blocks - 1), axis=1)
    return jnp.where(ok, block * block_size + pos % block_size, -1).astype(jnp.int32)


def _dense_attend(q, cache, batch: ModelBatch, *, sm_scale, impl, interpret) -> jax.Array:
    """Causal attention of absorbed queries against the latent pool as both keys and values."""
    return ragged_paged_attention(
        q,
        cache,
        cache,
        batch.kv_lens,
        batch.block_tables,
        batch.cu_q_lens,
        batch.num_seqs,
        sm_scale=sm_scale,
        # HF's MLA attends with q/k and v head dims that differ, which torch's sdpa serves by its
        # math path, in f32: no bf16 rounding of the probabilities (rounding.py).
        round_probabilities=False,
        impl=impl,
        interpret=interpret,
    )


class MLAttention(nnx.Module):
    """DeepSeek MLA of one layer; parameter names follow HF's DeepseekV3Attention.

    `sparse_backend` is the `sparse_mla_decode` choice for the `selected` path (DSA); a layer built
    without one serves dense causal attention only.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        dtype,
        *,
        backend: Choice,
        sparse_backend: Choice | None = None,
        use_rope: bool = True,
        interpret: bool | None = None,
    ):
        s = MLAShape.from_config(config)
        self.shape = s
        self.layer_idx = layer_idx
        self.backend = backend
        self.sparse_backend = sparse_backend
        # Kimi-Linear's MLA layers take no rope (`mla_use_nope`): q_pe and k_pe stay as projected.
        self.use_rope = use_rope
        # Pallas interpret mode of the paged-attention call (None: as `backend` says).
        self.interpret = interpret
        self.scale = softmax_scale(config)
        hidden, h, bias = config.hidden_size, s.num_heads, s.attention_bias
        if s.q_lora_rank is None:
            self.q_proj = Linear(hidden, h * s.qk_head_dim, bias=False, dtype=dtype)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(hidden, s.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, _LATENT_NORM_EPS, dtype)
            self.q_b_proj = Linear(s.q_lora_rank, h * s.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(hidden, s.latent_dim, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, _LATENT_NORM_EPS, dtype)
        self.kv_b_proj = Linear(
            s.kv_lora_rank, h * (s.qk_nope_head_dim + s.v_head_dim), bias=False, dtype=dtype
        )
        self.o_proj = Linear(h * s.v_head_dim, hidden, bias=bias, dtype=dtype)

    # The pieces, public so DeepSeek-V3.2's indexer layer can reuse them.

    def q_resid(self, x: jax.Array) -> jax.Array:
        """q_a_layernorm(q_a_proj(x)) [T, q_lora_rank]: the compressed query V3.2's indexer reads."""
        if self.q_a_proj is None:
            raise ValueError(f"layer {self.layer_idx}: q_lora_rank is None, there is no q_resid")
        return self.q_a_layernorm(self.q_a_proj(x))

    def project_q(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, q_resid: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """(q_nope absorbed through W_UK [T, H, kv_lora_rank], roped q_pe [T, H, rope])."""
        s = self.shape
        t = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_resid(x) if q_resid is None else q_resid)
        q = q.reshape(t, s.num_heads, s.qk_head_dim)
        q_nope, q_pe = q[..., : s.qk_nope_head_dim], q[..., s.qk_nope_head_dim :]
        if self.use_rope:
            q_pe = rotate_pe(q_pe, cos, sin, s.rope_interleave)
        w_uk = self._kv_b()[..., : s.qk_nope_head_dim]  # [R, H, nope]
        q_nope = compute.for_weight(q_nope, w_uk)
        q_lat = jnp.einsum("thn,rhn->thr", q_nope, w_uk, preferred_element_type=jnp.float32)
        return q_lat.astype(x.dtype), q_pe

    def project_latent(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """This step's cache rows [T, kv_lora_rank + rope]: kv_a_layernorm(c), then roped k_pe."""
        s = self.shape
        ckv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(ckv[:, : s.kv_lora_rank])
        k_pe = ckv[:, s.kv_lora_rank :]
        if self.use_rope:
            k_pe = rotate_pe(k_pe[:, None], cos, sin, s.rope_interleave)[:, 0]
        return jnp.concatenate([c, k_pe], axis=-1)

    def output(self, attn_latent: jax.Array) -> jax.Array:
        """Attention output in latent space [T, H, kv_lora_rank] -> W_UV -> o_proj -> [T, hidden]."""
        s = self.shape
        t = attn_latent.shape[0]
        w_uv = self._kv_b()[..., s.qk_nope_head_dim :]  # [R, H, v]
        latent = compute.for_weight(attn_latent, w_uv)
        v = jnp.einsum("thr,rhv->thv", latent, w_uv, preferred_element_type=jnp.float32)
        return self.o_proj(v.astype(attn_latent.dtype).reshape(t, s.num_heads * s.v_head_dim))

    def attend(
        self,
        q_lat: jax.Array,
        q_pe: jax.Array,
        cache: jax.Array,
        batch: ModelBatch,
        selected: jax.Array | None = None,
    ) -> jax.Array:
        """Attention in latent space [T, H, kv_lora_rank] against the pool (this step's rows
        already written): dense causal, or over each token's `selected` positions only."""
        r = self.shape.kv_lora_rank
        q = jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1).astype(cache.dtype)
        if selected is None:
            # Per device on its own heads under tensor parallelism; the latent pool is whole on
            # every device.
            heads = P(None, GROUP, None)
            attend = on_each_device(
                functools.partial(
                    _dense_attend, sm_scale=self.scale, impl=self.backend, interpret=self.interpret
                ),
                in_specs=(heads, P(), P()),
                out_specs=heads,
            )
            return attend(q, cache, batch)[..., :r].astype(q_lat.dtype)
        if self.sparse_backend is None:
            raise ValueError(
                f"layer {self.layer_idx}: `selected` positions given to an MLAttention built "
                "without a sparse_backend"
            )
        nb, bs, _, d = cache.shape
        slots = selected_slots(selected.astype(jnp.int32), batch, bs)
        out, _ = sparse_mla_decode(
            q,
            cache.reshape(nb * bs, d),
            slots,
            sm_scale=self.scale,
            d_v=r,
            impl=self.sparse_backend,
        )
        return out.astype(q_lat.dtype)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        latent_cache: tuple[jax.Array],
        batch: ModelBatch,
        *,
        selected: jax.Array | None = None,
        q_resid: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array]]:
        """x [T, hidden] (after input_layernorm) -> (out [T, hidden], latent_cache).

        `selected`: None for dense causal attention; else int32 [T, topk] absolute positions each
        token may attend to (-1 = none), DeepSeek-V3.2's indexer output. `q_resid`: the compressed
        query if the caller already computed it (the indexer reads it too).
        """
        (cache,) = latent_cache
        q_lat, q_pe = self.project_q(x, cos, sin, q_resid)
        cache = write_latent(cache, self.project_latent(x, cos, sin), batch.slot_mapping)
        out = self.attend(q_lat, q_pe, cache, batch, selected)
        return self.output(out), (cache,)

    def _kv_b(self) -> jax.Array:
        """kv_b_proj's weight as [kv_lora_rank, H, nope + v] (per head: W_UK then W_UV). XLA:CPU
        has no bf16 dot for the absorbed products taking it as [H, nope + v, kv_lora_rank]."""
        s = self.shape
        w = self.kv_b_proj.weight[...].reshape(s.num_heads, -1, s.kv_lora_rank)
        return w.transpose(2, 0, 1)
