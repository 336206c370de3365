"""DeepSeek-V3.2: DeepSeek-V3 (model/deepseek.py) with DSA sparse attention in every layer.

Each layer's MLA attends only to the top-`index_topk` positions its lightning indexer picks
(model/layers/sparse_mla.py, model/layers/dsa_indexer.py), computed as HF's `deepseek_v32` does
(docs/architecture.md, "DeepSeek sparse attention", says where that differs from DeepSeek's FP8
deployment). Two paged pools share the block table: the "MLA latent" rows and the
"DSA indexer keys" (one index_head_dim key per token and layer), so a block id, a prefix-cache hit
or a preemption covers both.
"""

from __future__ import annotations

import logging

from model.base import ModelOptions, PagedCacheSpec
from model.batch import ModelBatch
from model.config import ModelConfig
from model.deepseek import DeepseekDecoderLayer, DeepseekV3ForCausalLM
from model.layers.mla import MLAShape
from model.layers.sparse_mla import SparseMLAttention, choose_decode_backend, indexer_shape
from model.weight_spec import WeightSpec

log = logging.getLogger(__name__)


class DSADecoderLayer(DeepseekDecoderLayer):
    def attend(self, h, cos, sin, caches: tuple, batch: ModelBatch):
        """Attention over this layer's (MLA latent, DSA indexer keys) cache entries."""
        latent, keys = caches
        out, latent, keys = self.self_attn(h, cos, sin, latent, keys, batch)
        return out, (latent, keys)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    decoder_layer = DSADecoderLayer

    @classmethod
    def choose_backends(cls, config: ModelConfig, options: ModelOptions) -> tuple:
        decode = choose_decode_backend(config, options)
        if decode.impl != "reference":
            log.info(
                "DSA: decode tokens through %s; prefill chunks through the masked jnp reference",
                decode.describe(),
            )
        return (decode,)

    def make_attention(self, config: ModelConfig, layer_idx: int):
        return SparseMLAttention(
            config, layer_idx, config.jnp_dtype, decode_backend=self.backends[0]
        )

    @classmethod
    def cache_specs(cls, config: ModelConfig, options: ModelOptions) -> tuple[PagedCacheSpec, ...]:
        _, head_dim, _ = indexer_shape(config)
        keys = PagedCacheSpec(
            "DSA indexer keys",
            config.num_hidden_layers,
            ("keys",),
            (options.block_size, 1, head_dim),
            options.resolve_cache_dtype(config),
        )
        return (*super().cache_specs(config, options), keys)

    @classmethod
    def attention_weight_specs(cls, c: ModelConfig, layer_idx: int) -> list[WeightSpec]:
        num_heads, head_dim, _ = indexer_shape(c)
        q_lora = MLAShape.from_config(c).q_lora_rank
        hf = f"model.layers.{layer_idx}.self_attn.indexer."
        ours = ("model", "layers", layer_idx, "self_attn", "indexer")
        linears = (
            ("wq_b", (num_heads * head_dim, q_lora)),
            ("wk", (head_dim, c.hidden_size)),
            ("weights_proj", (num_heads, c.hidden_size)),
        )
        specs = [
            WeightSpec((*ours, name, "weight"), ((f"{hf}{name}.weight", shape),))
            for name, shape in linears
        ]
        specs += [
            WeightSpec((*ours, "k_norm", part), ((f"{hf}k_norm.{part}", (head_dim,)),))
            for part in ("weight", "bias")
        ]
        return [*super().attention_weight_specs(c, layer_idx), *specs]
