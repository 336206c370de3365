"""BERT: BertModel (embeddings, e.g. all-MiniLM-L6-v2) and BertForSequenceClassification.

Absolute position and token-type embeddings, post-LayerNorm residual blocks, GELU, and self-attention
within each sequence through the dense-attention op (pallas_kernels.flash_attention: the flash kernel
where it serves, the jnp reference on the CPU). Attention is bidirectional unless the configuration
says `is_decoder` (config.attention_type, decided in model/routing.py): the class never decides it.

Implements the model protocol of model/base.py for the pooling runner: no KV cache (an encoder
computes every prompt whole, in one step), `model(caches, batch) -> (caches, hidden [T, H])`, and
for the classification head `classify(pooled [S, H]) -> logits [S, num_labels]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.base import ModelOptions
from model.batch import ModelBatch
from model.config import ConfigError, ModelConfig
from model.layers.embeddings import Embedding
from model.layers.encoder_attention import choose_backend, ragged_self_attention
from model.layers.linear import Linear
from model.layers.norms import LayerNorm
from model.weight_spec import WeightSpec

# Buffers HF keeps next to the weights (saved by older transformers), never parameters.
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


def _settings(config: ModelConfig) -> tuple[float, int]:
    """(layer_norm_eps, type_vocab_size) from the configuration, refusing what is not served."""
    hf = config.hf_config
    kind = hf.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ConfigError(
            f"{config.path}: config field 'position_embedding_type' = {kind!r}: only 'absolute' "
            "position embeddings are served"
        )
    eps = hf.get("layer_norm_eps", 1e-12)
    types = hf.get("type_vocab_size", 2)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ConfigError(f"{config.path}: layer_norm_eps must be a positive number, got {eps!r}")
    if isinstance(types, bool) or not isinstance(types, int) or types <= 0:
        raise ConfigError(f"{config.path}: type_vocab_size must be a positive int, got {types!r}")
    if config.num_key_value_heads != config.num_attention_heads:
        raise ConfigError(
            f"{config.path}: BERT has one key/value head per query head, got "
            f"num_key_value_heads={config.num_key_value_heads} for "
            f"num_attention_heads={config.num_attention_heads}"
        )
    return float(eps), types


def _gelu(x: jax.Array, hidden_act: str) -> jax.Array:
    # "gelu" is the exact (erf) form; "gelu_new" and "gelu_pytorch_tanh" the tanh approximation.
    return jax.nn.gelu(x, approximate=hidden_act != "gelu")


class BertEmbeddings(nnx.Module):
    def __init__(self, cfg: ModelConfig, eps: float, type_vocab_size: int):
        dt = cfg.jnp_dtype
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, dt)
        self.position_embeddings = Embedding(cfg.max_position_embeddings, cfg.hidden_size, dt)
        self.token_type_embeddings = Embedding(type_vocab_size, cfg.hidden_size, dt)
        self.norm = LayerNorm(cfg.hidden_size, eps, dt)

    def __call__(self, batch: ModelBatch) -> jax.Array:
        types = batch.token_type_ids
        if types is None:
            types = jnp.zeros_like(batch.token_ids)
        x = (
            self.word_embeddings(batch.token_ids)
            + self.token_type_embeddings(types)
            + self.position_embeddings(batch.positions)
        )
        return self.norm(x)


class BertLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, eps: float, backend, block_size: int):
        dt, h = cfg.jnp_dtype, cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.qkv = Linear(h, 3 * h, bias=True, dtype=dt)  # HF's query, key, value
        self.attention_output = Linear(h, h, bias=True, dtype=dt)
        self.attention_norm = LayerNorm(h, eps, dt)
        self.intermediate = Linear(h, cfg.intermediate_size, bias=True, dtype=dt)
        self.output = Linear(cfg.intermediate_size, h, bias=True, dtype=dt)
        self.output_norm = LayerNorm(h, eps, dt)
        self.hidden_act = cfg.hidden_act
        self.causal = cfg.attention_type == "causal"
        self.max_len, self.block_size = cfg.max_model_len, block_size
        self.backend = backend

    def __call__(self, x: jax.Array, batch: ModelBatch) -> jax.Array:
        t, heads, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v = jnp.split(self.qkv(x).reshape(t, 3, heads, d), 3, axis=1)
        # Each sequence is padded to the longest the batch can hold: its block tables cover every
        # sequence's tokens, so their width bounds them (a static shape, bucketed by the runner
        # to the step's longest prompt); scores cost S x L^2, so short steps stay cheap.
        max_len = min(self.max_len, batch.block_tables.shape[1] * self.block_size)
        attended = ragged_self_attention(
            q[:, 0],
            k[:, 0],
            v[:, 0],
            batch.cu_q_lens,
            batch.num_seqs,
            max_len=max_len,
            causal=self.causal,
            sm_scale=d**-0.5,
            backend=self.backend,
        )
        # Post-LayerNorm residual blocks: normalise after adding, as BERT does.
        x = self.attention_norm(x + self.attention_output(attended.reshape(t, heads * d)))
        return self.output_norm(x + self.output(_gelu(self.intermediate(x), self.hidden_act)))


class BertEncoder(nnx.Module):
    """Embeddings and the layer stack: HF's BertModel without its pooler."""

    def __init__(self, cfg: ModelConfig, options: ModelOptions, backend):
        eps, types = _settings(cfg)
        self.embeddings = BertEmbeddings(cfg, eps, types)
        self.layers = nnx.List(
            [BertLayer(cfg, eps, backend, options.block_size) for _ in range(cfg.num_hidden_layers)]
        )

    def __call__(self, batch: ModelBatch) -> jax.Array:
        x = self.embeddings(batch)
        for layer in self.layers:
            x = layer(x, batch)
        return x


def _attention_backend(config: ModelConfig, options: ModelOptions):
    return choose_backend(
        num_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        dtype=config.dtype,
        causal=config.attention_type == "causal",
        impl=options.attention_backend,
    )


def _encoder_specs(c: ModelConfig, hf: str, ours: tuple) -> list[WeightSpec]:
    """The encoder's weights under HF prefix `hf` ("" or "bert.") and our module path `ours`."""
    h, inter = c.hidden_size, c.intermediate_size
    _, types = _settings(c)

    def vector(path: tuple, name: str, size: int) -> WeightSpec:
        return WeightSpec((*ours, *path), ((hf + name, (size,)),))

    def matrix(path: tuple, name: str, out: int, inp: int) -> WeightSpec:
        return WeightSpec((*ours, *path, "weight"), ((hf + name, (out, inp)),))

    emb = "embeddings."
    specs = [
        WeightSpec(
            (*ours, "embeddings", table, "weight"), ((f"{hf}{emb}{table}.weight", (rows, h)),)
        )
        for table, rows in (
            ("word_embeddings", c.vocab_size),
            ("position_embeddings", c.max_position_embeddings),
            ("token_type_embeddings", types),
        )
    ]
    specs += [
        vector(("embeddings", "norm", "weight"), emb + "LayerNorm.weight", h),
        vector(("embeddings", "norm", "bias"), emb + "LayerNorm.bias", h),
    ]
    for i in range(c.num_hidden_layers):
        layer, at = f"encoder.layer.{i}.", ("layers", i)
        attn = layer + "attention."
        qkv = ("query", "key", "value")
        specs += [
            WeightSpec(
                (*ours, *at, "qkv", "weight"),
                tuple((f"{hf}{attn}self.{n}.weight", (h, h)) for n in qkv),
            ),
            WeightSpec(
                (*ours, *at, "qkv", "bias"),
                tuple((f"{hf}{attn}self.{n}.bias", (h,)) for n in qkv),
            ),
            matrix((*at, "attention_output"), attn + "output.dense.weight", h, h),
            vector((*at, "attention_output", "bias"), attn + "output.dense.bias", h),
            vector((*at, "attention_norm", "weight"), attn + "output.LayerNorm.weight", h),
            vector((*at, "attention_norm", "bias"), attn + "output.LayerNorm.bias", h),
            matrix((*at, "intermediate"), layer + "intermediate.dense.weight", inter, h),
            vector((*at, "intermediate", "bias"), layer + "intermediate.dense.bias", inter),
            matrix((*at, "output"), layer + "output.dense.weight", h, inter),
            vector((*at, "output", "bias"), layer + "output.dense.bias", h),
            vector((*at, "output_norm", "weight"), layer + "output.LayerNorm.weight", h),
            vector((*at, "output_norm", "bias"), layer + "output.LayerNorm.bias", h),
        ]
    return specs


class BertModel(nnx.Module):
    """An embedding model: the encoder's last hidden states, pooled by the runner
    (model/layers/pooler.py, config.pooling_type). HF's pooler (dense + tanh) is not used."""

    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions()):  # noqa: B008
        self.config = config
        backend = _attention_backend(config, options)
        self.backends = (backend,)
        self.encoder = BertEncoder(config, options, backend)

    @classmethod
    def cache_specs(cls, config: ModelConfig, options: ModelOptions) -> tuple:
        return ()  # no KV cache: every prompt is computed whole, in one step

    def __call__(self, caches: tuple, batch: ModelBatch) -> tuple[tuple, jax.Array]:
        if caches:
            raise ValueError(f"BERT keeps no cache, got {len(caches)} cache entries")
        return caches, self.encoder(batch)

    @classmethod
    def hf_weight_specs(cls, c: ModelConfig) -> tuple[WeightSpec, ...]:
        return tuple(_encoder_specs(c, "", ("encoder",)))

    @staticmethod
    def hf_ignored_weight(name: str, c: ModelConfig) -> bool:
        # The pooler (dense + tanh on [CLS]) serves BERT's pretraining head, not embeddings.
        return name in _BUFFERS or name.startswith("pooler.")


class BertForSequenceClassification(nnx.Module):
    """A classifier or cross-encoder: the encoder, then `classify` on the pooled first token."""

    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions()):  # noqa: B008
        if config.num_labels is None:
            raise ConfigError(f"{config.path}: {config.architecture} needs num_labels (id2label)")
        self.config = config
        backend = _attention_backend(config, options)
        self.backends = (backend,)
        dt, h = config.jnp_dtype, config.hidden_size
        self.encoder = BertEncoder(config, options, backend)
        self.pooler = Linear(h, h, bias=True, dtype=dt)
        self.classifier = Linear(h, config.num_labels, bias=True, dtype=dt)

    @classmethod
    def cache_specs(cls, config: ModelConfig, options: ModelOptions) -> tuple:
        return ()

    def __call__(self, caches: tuple, batch: ModelBatch) -> tuple[tuple, jax.Array]:
        if caches:
            raise ValueError(f"BERT keeps no cache, got {len(caches)} cache entries")
        return caches, self.encoder(batch)

    def classify(self, pooled: jax.Array) -> jax.Array:
        """pooled [S, H] (each sequence's first token) -> float32 logits [S, num_labels]."""
        return self.classifier(jnp.tanh(self.pooler(pooled))).astype(jnp.float32)

    @classmethod
    def hf_weight_specs(cls, c: ModelConfig) -> tuple[WeightSpec, ...]:
        h, n = c.hidden_size, c.num_labels
        return (
            *_encoder_specs(c, "bert.", ("encoder",)),
            WeightSpec(("pooler", "weight"), (("bert.pooler.dense.weight", (h, h)),)),
            WeightSpec(("pooler", "bias"), (("bert.pooler.dense.bias", (h,)),)),
            WeightSpec(("classifier", "weight"), (("classifier.weight", (n, h)),)),
            WeightSpec(("classifier", "bias"), (("classifier.bias", (n,)),)),
        )

    @staticmethod
    def hf_ignored_weight(name: str, c: ModelConfig) -> bool:
        return name.removeprefix("bert.") in _BUFFERS
