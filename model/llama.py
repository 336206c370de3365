"""The Llama family: LlamaForCausalLM, Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (q/k norm).

Implements the model protocol of model/base.py: the modules hold parameters only, and the runner
jits `model.base.forward` / `compute_logits` with the KV cache donated and no weights closed over.
The cache is one paged K/V pool over all layers; the paged-attention kernel is chosen once, when the
model is built, for every layer.
"""

from __future__ import annotations

import jax
from flax import nnx

from model.base import ModelOptions, PagedCacheSpec, paged_kv_spec
from model.batch import ModelBatch
from model.config import ModelConfig
from model.layers.attention import Attention, choose_backend
from model.layers.decoder import DecoderStack, PreNormLayer, head_logits, own_lm_head
from model.layers.mlp import GatedMLP
from model.layers.rotary import rotary_cos_sin
from model.weight_spec import (
    WeightSpec,
    embedding_spec,
    gated_mlp_specs,
    head_specs,
    layer_norm_specs,
)

KVCache = tuple[tuple[jax.Array, jax.Array], ...]  # per layer (k, v): [blocks, block, Hkv, D]


class DecoderLayer(PreNormLayer):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        attention_backend,
    ):
        dt = cfg.jnp_dtype
        attention = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm_eps=cfg.rms_norm_eps if qk_norm else None,
            sliding_window=cfg.sliding_windows[layer_idx],
            backend=attention_backend,
            dtype=dt,
        )
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dt)
        super().__init__(cfg, attention, mlp)

    def __call__(self, x, cos, sin, kv_cache, batch, rows=None):
        return self.residual(x, lambda h: self.self_attn(h, cos, sin, kv_cache, batch), rows)


class LlamaModel(DecoderStack):
    def __init__(self, cfg: ModelConfig, **attn_style):
        layers = [DecoderLayer(cfg, i, **attn_style) for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers)
        self.rope = cfg.rope


class LlamaForCausalLM(nnx.Module):
    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions()):  # noqa: B008
        self.config = config
        windows = [w for w in config.sliding_windows if w is not None]
        attention_backend = choose_backend(
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=config.dtype,
            cache_dtype=options.resolve_cache_dtype(config),
            block_size=options.block_size,
            sliding_window=windows[0] if windows else None,
            impl=options.attention_backend,
        )
        self.backends = (attention_backend,)
        self.model = LlamaModel(
            config,
            qkv_bias=self.qkv_bias(config),
            o_bias=self.o_bias(config),
            qk_norm=self.qk_norm(config),
            attention_backend=attention_backend,
        )
        self.lm_head = own_lm_head(config)

    # Per-family attention layout, from the configuration.
    @staticmethod
    def qkv_bias(cfg: ModelConfig) -> bool:
        return cfg.attention_bias

    @staticmethod
    def o_bias(cfg: ModelConfig) -> bool:
        return cfg.attention_bias

    @staticmethod
    def qk_norm(cfg: ModelConfig) -> bool:
        return False

    @classmethod
    def cache_specs(cls, config: ModelConfig, options: ModelOptions) -> tuple[PagedCacheSpec, ...]:
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

    def __call__(self, kv_caches: KVCache, batch: ModelBatch, rows: jax.Array | None = None):
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(
                f"got {len(kv_caches)} KV cache layers for {len(self.model.layers)} attention layers"
            )
        x = self.model.embed_tokens(batch.token_ids)
        cos, sin = rotary_cos_sin(batch.positions, self.model.rope, x.dtype)
        new_caches = []
        last = len(kv_caches) - 1
        for i, (layer, kv) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            x, kv = layer(x, cos, sin, kv, batch, rows if i == last else None)
            new_caches.append(kv)
        return tuple(new_caches), self.model.norm(x)

    def compute_logits(self, hidden_rows: jax.Array) -> jax.Array:
        return head_logits(self.model, self.lm_head, hidden_rows)

    @classmethod
    def hf_weight_specs(cls, c: ModelConfig) -> tuple[WeightSpec, ...]:
        h, d, inter = c.hidden_size, c.head_dim, c.intermediate_size
        nq, nkv = c.num_attention_heads * d, c.num_key_value_heads * d
        specs = [embedding_spec(c.vocab_size, h)]
        for i in range(c.num_hidden_layers):
            hf, ours = f"model.layers.{i}.", ("model", "layers", i)
            attn = hf + "self_attn."
            qkv = (("q", nq), ("k", nkv), ("v", nkv))
            specs.append(
                WeightSpec(
                    (*ours, "self_attn", "qkv_proj", "weight"),
                    tuple((f"{attn}{n}_proj.weight", (o, h)) for n, o in qkv),
                )
            )
            if cls.qkv_bias(c):
                specs.append(
                    WeightSpec(
                        (*ours, "self_attn", "qkv_proj", "bias"),
                        tuple((f"{attn}{n}_proj.bias", (o,)) for n, o in qkv),
                    )
                )
            specs.append(
                WeightSpec(
                    (*ours, "self_attn", "o_proj", "weight"), ((attn + "o_proj.weight", (h, nq)),)
                )
            )
            if cls.o_bias(c):
                specs.append(
                    WeightSpec(
                        (*ours, "self_attn", "o_proj", "bias"), ((attn + "o_proj.bias", (h,)),)
                    )
                )
            if cls.qk_norm(c):
                for n in ("q_norm", "k_norm"):
                    specs.append(
                        WeightSpec(
                            (*ours, "self_attn", n, "weight"), ((f"{attn}{n}.weight", (d,)),)
                        )
                    )
            mlp = hf + "mlp."
            specs += gated_mlp_specs((*ours, "mlp"), hf + "mlp", h, inter)
            if c.mlp_bias:
                specs.append(
                    WeightSpec(
                        (*ours, "mlp", "gate_up_proj", "bias"),
                        ((mlp + "gate_proj.bias", (inter,)), (mlp + "up_proj.bias", (inter,))),
                    )
                )
                specs.append(
                    WeightSpec(
                        (*ours, "mlp", "down_proj", "bias"), ((mlp + "down_proj.bias", (h,)),)
                    )
                )
            specs += layer_norm_specs(i, h)
        specs += head_specs(c.vocab_size, h, c.tie_word_embeddings)
        return tuple(specs)

    @staticmethod
    def hf_ignored_weight(name: str, c: ModelConfig) -> bool:
        """On-disk tensors that are legitimately unused: rotary buffers some exporters save, and a
        duplicate LM head next to tied embeddings."""
        return name.endswith("rotary_emb.inv_freq") or (
            c.tie_word_embeddings and name == "lm_head.weight"
        )


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qkv_bias(cfg: ModelConfig) -> bool:
        return True

    @staticmethod
    def o_bias(cfg: ModelConfig) -> bool:
        return False


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qk_norm(cfg: ModelConfig) -> bool:
        return True
