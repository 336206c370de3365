"""DeepSeek-V3: MLA attention (model/layers/mla.py) and DeepSeekMoE (model/layers/moe.py).

Implements the model protocol of model/base.py. The cache is one paged "MLA latent" pool: per layer
and token one row of kv_lora_rank + qk_rope_head_dim values. Layers below `first_k_dense_replace`
use a dense SwiGLU MLP, the rest the routed-expert MoE, as HF's DeepseekV3DecoderLayer does.

DeepSeek-V3.2 (model/deepseek_v32.py) subclasses these classes; the places it changes are methods:
`DeepseekV3ForCausalLM.choose_backends`, `.make_attention`, `.cache_specs` and
`.attention_weight_specs`, and `DeepseekDecoderLayer.attend` (one layer's attention over its
cache entries, one entry per cache spec).
"""

from __future__ import annotations

import jax
from flax import nnx

from model.base import ModelOptions, PagedCacheSpec
from model.batch import ModelBatch
from model.config import ConfigError, ModelConfig
from model.layers.decoder import DecoderStack, PreNormLayer, head_logits, own_lm_head
from model.layers.mla import MLAShape, MLAttention, choose_backend, mla_rope
from model.layers.mlp import GatedMLP
from model.layers.rotary import rotary_cos_sin
from model.weight_spec import (
    WeightSpec,
    embedding_spec,
    gated_mlp_specs,
    head_specs,
    layer_norm_specs,
    past_last_layer,
)

# HF's DeepseekV3Config default, for checkpoints whose config.json leaves the key out.
_FIRST_K_DENSE_DEFAULT = 3


def first_k_dense(config: ModelConfig) -> int:
    k = config.hf_config.get("first_k_dense_replace", _FIRST_K_DENSE_DEFAULT)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ConfigError(
            f"{config.path}: config field 'first_k_dense_replace' must be an int >= 0, got {k!r}"
        )
    return k


def is_moe_layer(config: ModelConfig, layer_idx: int) -> bool:
    return layer_idx >= first_k_dense(config)


class DeepseekDecoderLayer(PreNormLayer):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        attention: nnx.Module,
        *,
        expert_parallel: bool = False,
    ):
        dt = cfg.jnp_dtype
        if is_moe_layer(cfg, layer_idx):
            from model.layers.moe import DeepseekMoE  # only MoE checkpoints need it

            mlp = DeepseekMoE(cfg, dt, expert_parallel=expert_parallel)
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dt)
        super().__init__(cfg, attention, mlp)

    def attend(self, h, cos, sin, caches: tuple, batch: ModelBatch):
        """(attention output [T, hidden], caches): `caches` holds this layer's entry of every
        cache spec, in spec order; V3 has one, the MLA latent."""
        (latent,) = caches
        out, latent = self.self_attn(h, cos, sin, latent, batch)
        return out, (latent,)

    def __call__(self, x, cos, sin, caches: tuple, batch: ModelBatch, rows=None):
        return self.residual(x, lambda h: self.attend(h, cos, sin, caches, batch), rows)


class DeepseekV3ForCausalLM(nnx.Module):
    decoder_layer = DeepseekDecoderLayer  # V3.2's layer attends over two cache entries

    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions()):  # noqa: B008
        self.config = config
        self.rope = mla_rope(config)
        self.backends = self.choose_backends(config, options)
        self.num_pools = len(type(self).cache_specs(config, options))
        layers = [
            type(self).decoder_layer(
                config,
                i,
                self.make_attention(config, i),
                expert_parallel=options.expert_parallel,
            )
            for i in range(config.num_hidden_layers)
        ]
        self.model = DecoderStack(config, layers)
        self.lm_head = own_lm_head(config)

    # What V3.2 overrides.

    @classmethod
    def choose_backends(cls, config: ModelConfig, options: ModelOptions) -> tuple:
        """The kernel choices (pallas_kernels.backends.Choice), made once here and logged."""
        return (
            choose_backend(
                config,
                cache_dtype=options.resolve_cache_dtype(config),
                block_size=options.block_size,
                impl=options.attention_backend,
            ),
        )

    def make_attention(self, config: ModelConfig, layer_idx: int) -> nnx.Module:
        return MLAttention(config, layer_idx, config.jnp_dtype, backend=self.backends[0])

    @classmethod
    def cache_specs(cls, config: ModelConfig, options: ModelOptions) -> tuple[PagedCacheSpec, ...]:
        shape = MLAShape.from_config(config)
        return (
            PagedCacheSpec(
                "MLA latent",
                config.num_hidden_layers,
                ("latent",),
                (options.block_size, 1, shape.latent_dim),
                options.resolve_cache_dtype(config),
            ),
        )

    # The protocol.

    def __call__(self, caches: tuple, batch: ModelBatch, rows: jax.Array | None = None):
        layers = self.model.layers
        n = len(layers)
        if len(caches) != n * self.num_pools:
            raise ValueError(
                f"got {len(caches)} cache entries for {n} layers x {self.num_pools} cache specs"
            )
        x = self.model.embed_tokens(batch.token_ids)
        cos, sin = rotary_cos_sin(batch.positions, self.rope, x.dtype)
        new = []
        for i, layer in enumerate(layers):
            # Spec order: spec 0's layers, then spec 1's (model/base.py).
            x, entries = layer(
                x,
                cos,
                sin,
                tuple(caches[p * n + i] for p in range(self.num_pools)),
                batch,
                rows if i == n - 1 else None,
            )
            new.append(entries)
        return tuple(new[i][p] for p in range(self.num_pools) for i in range(n)), self.model.norm(x)

    def compute_logits(self, hidden_rows: jax.Array) -> jax.Array:
        return head_logits(self.model, self.lm_head, hidden_rows)

    @classmethod
    def hf_weight_specs(cls, c: ModelConfig) -> tuple[WeightSpec, ...]:
        h = c.hidden_size
        specs = [embedding_spec(c.vocab_size, h)]
        for i in range(c.num_hidden_layers):
            specs += cls.attention_weight_specs(c, i)
            specs += cls.mlp_weight_specs(c, i)
            specs += layer_norm_specs(i, h)
        specs += head_specs(c.vocab_size, h, c.tie_word_embeddings)
        return tuple(specs)

    @classmethod
    def attention_weight_specs(cls, c: ModelConfig, layer_idx: int) -> list[WeightSpec]:
        s = MLAShape.from_config(c)
        h, nh = c.hidden_size, s.num_heads
        hf = f"model.layers.{layer_idx}.self_attn."
        ours = ("model", "layers", layer_idx, "self_attn")

        def linear(name, out_features, in_features, bias=False):
            out = [
                WeightSpec(
                    (*ours, name, "weight"),
                    ((f"{hf}{name}.weight", (out_features, in_features)),),
                )
            ]
            if bias:
                out.append(
                    WeightSpec((*ours, name, "bias"), ((f"{hf}{name}.bias", (out_features,)),))
                )
            return out

        def norm(name, dim):
            return [WeightSpec((*ours, name, "weight"), ((f"{hf}{name}.weight", (dim,)),))]

        specs = []
        if s.q_lora_rank is None:
            specs += linear("q_proj", nh * s.qk_head_dim, h)
        else:
            specs += linear("q_a_proj", s.q_lora_rank, h, s.attention_bias)
            specs += norm("q_a_layernorm", s.q_lora_rank)
            specs += linear("q_b_proj", nh * s.qk_head_dim, s.q_lora_rank)
        specs += linear("kv_a_proj_with_mqa", s.latent_dim, h, s.attention_bias)
        specs += norm("kv_a_layernorm", s.kv_lora_rank)
        specs += linear("kv_b_proj", nh * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)
        specs += linear("o_proj", h, nh * s.v_head_dim, s.attention_bias)
        return specs

    @classmethod
    def mlp_weight_specs(cls, c: ModelConfig, layer_idx: int) -> list[WeightSpec]:
        hf, ours = f"model.layers.{layer_idx}.mlp", ("model", "layers", layer_idx, "mlp")
        if is_moe_layer(c, layer_idx):
            from model.layers.moe import moe_weight_specs

            return list(moe_weight_specs(ours, hf, c))
        return gated_mlp_specs(ours, hf, c.hidden_size, c.intermediate_size)

    @staticmethod
    def hf_ignored_weight(name: str, c: ModelConfig) -> bool:
        """Legitimately unused on-disk tensors: rotary buffers, a duplicate tied head, and the
        multi-token-prediction layers DeepSeek checkpoints store after the last decoder layer
        (model.layers.{num_hidden_layers}...), which plain decoding does not run."""
        if name.endswith("rotary_emb.inv_freq"):
            return True
        if c.tie_word_embeddings and name == "lm_head.weight":
            return True
        return past_last_layer(name, c.num_hidden_layers)
