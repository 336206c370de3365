"""Gemma text layers (the language model of PaliGemma and ColPali) and GemmaForCausalLM.

What sets Gemma apart from Llama: token embeddings scaled by sqrt(hidden_size) (rounded to the
weights' dtype, as HF does), GeGLU (tanh GELU) MLPs, RMSNorm weights stored as an offset from 1
and applied in f32 before rounding, a tied LM head, and head dim 256 in the released checkpoints
(served by whichever paged-attention implementation the backend registry finds eligible).

`GemmaTextModel` takes its input embeddings from the caller, so PaliGemma can splice image
embeddings in, and an optional bidirectional prefix length per sequence (a prefix LM).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.base import ModelOptions, PagedCacheSpec, paged_kv_spec
from model.batch import ModelBatch
from model.config import ModelConfig
from model.layers.attention import Attention, choose_backend
from model.layers.decoder import DecoderStack, PreNormLayer
from model.layers.embeddings import lm_logits
from model.layers.mlp import GatedMLP
from model.layers.norms import OffsetRMSNorm
from model.layers.rotary import rotary_cos_sin
from model.weight_spec import WeightSpec, gated_mlp_specs


def gemma_backend(config: ModelConfig, options: ModelOptions, *, prefix_lm: bool):
    """The paged-attention choice for every Gemma layer (one decision, logged with its reason)."""
    return choose_backend(
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=config.dtype,
        cache_dtype=options.resolve_cache_dtype(config),
        block_size=options.block_size,
        sliding_window=None,
        impl=options.attention_backend,
        prefix_lm=prefix_lm,
    )


def gemma_cache_specs(config: ModelConfig, options: ModelOptions) -> tuple[PagedCacheSpec, ...]:
    c = config
    return (
        paged_kv_spec(
            c.num_hidden_layers,
            options.block_size,
            c.num_key_value_heads,
            c.head_dim,
            options.resolve_cache_dtype(c),
        ),
    )


class GemmaDecoderLayer(PreNormLayer):
    def __init__(self, cfg: ModelConfig, backend):
        dt = cfg.jnp_dtype
        attention = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            qk_norm_eps=None,
            sliding_window=None,
            backend=backend,
            dtype=dt,
        )
        mlp = GatedMLP(
            cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dt, act=cfg.hidden_act
        )
        super().__init__(cfg, attention, mlp, norm=OffsetRMSNorm)

    def __call__(self, x, cos, sin, kv_cache, batch, prefix_lens, rows=None):
        return self.residual(
            x, lambda h: self.self_attn(h, cos, sin, kv_cache, batch, prefix_lens), rows
        )


class GemmaTextModel(DecoderStack):
    """Embeddings, decoder layers and the final norm (HF's GemmaModel)."""

    def __init__(self, cfg: ModelConfig, backend):
        layers = [GemmaDecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers, norm=OffsetRMSNorm)
        self.rope = cfg.rope
        self.hidden_size = cfg.hidden_size

    def embed(self, token_ids: jax.Array) -> jax.Array:
        """Token embeddings times sqrt(hidden_size), the factor rounded to the model's dtype."""
        x = self.embed_tokens(token_ids)
        return x * jnp.asarray(self.hidden_size**0.5, x.dtype)

    def __call__(
        self,
        kv_caches: tuple,
        batch: ModelBatch,
        x: jax.Array,
        *,
        prefix_lens: jax.Array | None = None,
        position_offset: int = 0,
        rows: jax.Array | None = None,
    ):
        """x [T, hidden]: the input embeddings; `position_offset` is added to the rotary positions
        (PaliGemma counts from 1). Returns (caches, normed hidden [T, hidden]; of `rows` only
        where given)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"got {len(kv_caches)} KV cache layers for {len(self.layers)} attention layers"
            )
        cos, sin = rotary_cos_sin(batch.positions + position_offset, self.rope, x.dtype)
        new_caches = []
        last = len(kv_caches) - 1
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, kv = layer(x, cos, sin, kv, batch, prefix_lens, rows if i == last else None)
            new_caches.append(kv)
        return tuple(new_caches), self.norm(x)


def gemma_specs(c: ModelConfig, hf: str, ours: tuple) -> list[WeightSpec]:
    """GemmaTextModel's weights from HF names under prefix `hf` (e.g. "model." or
    "language_model.model."), at our module path `ours`."""
    h, d, inter = c.hidden_size, c.head_dim, c.intermediate_size
    nq, nkv = c.num_attention_heads * d, c.num_key_value_heads * d
    specs = [
        WeightSpec(
            (*ours, "embed_tokens", "weight"), ((hf + "embed_tokens.weight", (c.vocab_size, h)),)
        ),
        WeightSpec((*ours, "norm", "weight"), ((hf + "norm.weight", (h,)),)),
    ]
    for i in range(c.num_hidden_layers):
        layer, at = f"{hf}layers.{i}.", (*ours, "layers", i)
        attn = layer + "self_attn."
        qkv = (("q", nq), ("k", nkv), ("v", nkv))
        specs += [
            WeightSpec(
                (*at, "self_attn", "qkv_proj", "weight"),
                tuple((f"{attn}{n}_proj.weight", (o, h)) for n, o in qkv),
            ),
            WeightSpec(
                (*at, "self_attn", "o_proj", "weight"), ((attn + "o_proj.weight", (h, nq)),)
            ),
            *gated_mlp_specs((*at, "mlp"), layer + "mlp", h, inter),
        ]
        if c.attention_bias:
            specs += [
                WeightSpec(
                    (*at, "self_attn", "qkv_proj", "bias"),
                    tuple((f"{attn}{n}_proj.bias", (o,)) for n, o in qkv),
                ),
                WeightSpec((*at, "self_attn", "o_proj", "bias"), ((attn + "o_proj.bias", (h,)),)),
            ]
        specs += [
            WeightSpec((*at, n, "weight"), ((f"{layer}{n}.weight", (h,)),))
            for n in ("input_layernorm", "post_attention_layernorm")
        ]
    return specs


class GemmaForCausalLM(nnx.Module):
    """Gemma (1) as a causal language model; the LM head is the embedding table (tied)."""

    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions()):  # noqa: B008
        self.config = config
        backend = gemma_backend(config, options, prefix_lm=False)
        self.backends = (backend,)
        self.model = GemmaTextModel(config, backend)

    @classmethod
    def cache_specs(cls, config: ModelConfig, options: ModelOptions) -> tuple[PagedCacheSpec, ...]:
        return gemma_cache_specs(config, options)

    def __call__(self, kv_caches: tuple, batch: ModelBatch, rows: jax.Array | None = None):
        return self.model(kv_caches, batch, self.model.embed(batch.token_ids), rows=rows)

    def compute_logits(self, hidden_rows: jax.Array) -> jax.Array:
        return lm_logits(hidden_rows, self.model.embed_tokens.weight[...])

    @classmethod
    def hf_weight_specs(cls, c: ModelConfig) -> tuple[WeightSpec, ...]:
        return tuple(gemma_specs(c, "model.", ("model",)))

    @staticmethod
    def hf_ignored_weight(name: str, c: ModelConfig) -> bool:
        return name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq")
