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
from model.layers.embeddings import Embedding, lm_logits
from model.layers.mlp import GatedMLP
from model.layers.norms import RMSNorm
from model.layers.rotary import rotary_cos_sin
from model.weight_spec import WeightSpec, embedding_spec, head_specs, layer_norm_specs

KVCache = tuple[tuple[jax.Array, jax.Array], ...]  # per layer (k, v): [blocks, block, Hkv, D]


class DecoderLayer(nnx.Module):
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
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.self_attn = Attention(
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
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dt)

    def __call__(self, x, cos, sin, kv_cache, batch):
        h, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, batch)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class LlamaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, **attn_style):
        dt = cfg.jnp_dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dt)
        self.layers = nnx.List(
            [DecoderLayer(cfg, i, **attn_style) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
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
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Embedding(config.vocab_size, config.hidden_size, config.jnp_dtype)
        )

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

    def __call__(self, kv_caches: KVCache, batch: ModelBatch):
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(
                f"got {len(kv_caches)} KV cache layers for {len(self.model.layers)} attention layers"
            )
        x = self.model.embed_tokens(batch.token_ids)
        cos, sin = rotary_cos_sin(batch.positions, self.model.rope, x.dtype)
        new_caches = []
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x, kv = layer(x, cos, sin, kv, batch)
            new_caches.append(kv)
        return tuple(new_caches), self.model.norm(x)

    def compute_logits(self, hidden_rows: jax.Array) -> jax.Array:
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return lm_logits(hidden_rows, head.weight[...])

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
                    (*ours, "self_attn", "qkv_proj", "kernel"),
                    tuple((f"{attn}{n}_proj.weight", (o, h)) for n, o in qkv),
                    True,
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
                    (*ours, "self_attn", "o_proj", "kernel"),
                    ((attn + "o_proj.weight", (h, nq)),),
                    True,
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
            specs.append(
                WeightSpec(
                    (*ours, "mlp", "gate_up_proj", "kernel"),
                    ((mlp + "gate_proj.weight", (inter, h)), (mlp + "up_proj.weight", (inter, h))),
                    True,
                )
            )
            specs.append(
                WeightSpec(
                    (*ours, "mlp", "down_proj", "kernel"),
                    ((mlp + "down_proj.weight", (h, inter)),),
                    True,
                )
            )
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
