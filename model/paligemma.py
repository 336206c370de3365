"""PaliGemma (PaliGemmaForConditionalGeneration) and ColPali (ColPaliForRetrieval): a SigLIP vision
tower and a linear projector feeding image embeddings into a Gemma language model.

The prompt is laid out as HF's processor lays it out: num_image_tokens placeholder tokens
(image_token_id) first, then the text. The runner's encoder path calls `encode_images` for the
images a step needs, and splices those rows into the step through ModelBatch.mm_embeds /
mm_mask; the placeholders' own token embeddings are never used. Image embeddings enter unscaled:
HF scales only the token embeddings by sqrt(hidden_size).

Attention is PaliGemma's prefix LM: the image and prompt tokens (ModelBatch.prefix_lens per
sequence) attend to each other both ways, the generated suffix causally, as HF computes it when its
processor passes token_type_ids (0 over image and prompt, 1 over a suffix). Without prefix_lens
the model is causal; the runner always passes them, since HF 5's PaliGemma attends its whole first
forward both ways even without token_type_ids (text_config.use_bidirectional_attention defaults to
true and SDPA then drops the causal mask), so a prompt is always a prefix. ColPali's whole input
is the prefix (its processor marks every token 0), so it attends bidirectionally over each
sequence, which the pooling runner computes whole in one step. Rotary positions count from 1,
as HF's PaliGemma does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.base import ModelOptions, PagedCacheSpec
from model.batch import ModelBatch
from model.config import ConfigError, ModelConfig
from model.gemma import GemmaTextModel, gemma_backend, gemma_cache_specs, gemma_specs
from model.layers.embeddings import lm_logits
from model.layers.linear import Linear
from model.siglip import SiglipVisionTower, VisionConfig, siglip_specs
from model.siglip import choose_backend as vision_backend
from model.weight_spec import WeightSpec


def _vlm(config: ModelConfig):
    """The PaliGemma part of the checkpoint's config.json (ColPali nests it in vlm_config)."""
    hf = config.hf_config
    return hf["vlm_config"] if config.model_type == "colpali" else hf


def _settings(config: ModelConfig) -> tuple[VisionConfig, int, int]:
    """(vision config, image_token_id, projection_dim), refusing what is not served."""
    vlm = _vlm(config)
    vision = VisionConfig.from_hf(vlm.get("vision_config") or {}, config.path)
    token = vlm.get("image_token_id", vlm.get("image_token_index"))
    if not isinstance(token, int) or not 0 <= token < config.vocab_size:
        raise ConfigError(
            f"{config.path}: image_token_index must be a token id below vocab_size "
            f"{config.vocab_size}, got {token!r}"
        )
    proj = vlm.get("projection_dim", (vlm.get("vision_config") or {}).get("projection_dim"))
    if proj != config.hidden_size:
        raise ConfigError(
            f"{config.path}: projection_dim {proj!r} must equal the language model's hidden_size "
            f"{config.hidden_size} (the projector's output is spliced into its embeddings)"
        )
    text = vlm.get("text_config") or {}
    declared = text.get("num_image_tokens")
    if declared is not None and declared != vision.num_patches:
        raise ConfigError(
            f"{config.path}: text_config.num_image_tokens {declared} disagrees with the vision "
            f"tower's (image_size / patch_size)^2 = {vision.num_patches}"
        )
    if text.get("final_logit_softcapping") is not None:
        raise ConfigError(f"{config.path}: final_logit_softcapping is not served")
    if not config.tie_word_embeddings:
        raise ConfigError(f"{config.path}: PaliGemma's LM head is tied to its embeddings")
    return vision, token, proj


class PaliGemmaForConditionalGeneration(nnx.Module):
    _hf_prefix = ""  # ColPali's checkpoint puts the same tensors under "vlm."
    _prefix_is_whole_input = False

    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions()):  # noqa: B008
        self.config = config
        vision, token, _ = _settings(config)
        self.image_size = vision.image_size
        self.num_image_tokens = vision.num_patches
        self.image_token_id = token
        text_backend = gemma_backend(config, options, prefix_lm=True)
        image_backend = vision_backend(vision, config.dtype, options.attention_backend)
        self.backends = (text_backend, image_backend)
        dt = config.jnp_dtype
        self.vision_tower = SiglipVisionTower(vision, image_backend, dt)
        self.multi_modal_projector = Linear(
            vision.hidden_size, config.hidden_size, bias=True, dtype=dt
        )
        self.language_model = GemmaTextModel(config, text_backend)

    @classmethod
    def cache_specs(cls, config: ModelConfig, options: ModelOptions) -> tuple[PagedCacheSpec, ...]:
        return gemma_cache_specs(config, options)

    def encode_images(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values [N, 3, image_size, image_size] (already resized, rescaled and normalised)
        -> [N, num_image_tokens, hidden]: what replaces each image's placeholder tokens."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def hidden_states(self, kv_caches: tuple, batch: ModelBatch, rows: jax.Array | None = None):
        x = self.language_model.embed(batch.token_ids)
        if (batch.mm_embeds is None) != (batch.mm_mask is None):
            raise ValueError("ModelBatch.mm_embeds and mm_mask come together (both or neither)")
        if batch.mm_embeds is not None:
            if batch.mm_embeds.shape != x.shape or batch.mm_mask.shape != x.shape[:1]:
                raise ValueError(
                    f"mm_embeds {batch.mm_embeds.shape} and mm_mask {batch.mm_mask.shape} must be "
                    f"{x.shape} and {x.shape[:1]} (one row per token of the step)"
                )
            x = jnp.where(batch.mm_mask[:, None], batch.mm_embeds.astype(x.dtype), x)
        prefix = batch.kv_lens if self._prefix_is_whole_input else batch.prefix_lens
        return self.language_model(
            kv_caches, batch, x, prefix_lens=prefix, position_offset=1, rows=rows
        )

    def __call__(self, kv_caches: tuple, batch: ModelBatch, rows: jax.Array | None = None):
        return self.hidden_states(kv_caches, batch, rows)

    def compute_logits(self, hidden_rows: jax.Array) -> jax.Array:
        return lm_logits(hidden_rows, self.language_model.embed_tokens.weight[...])

    @classmethod
    def hf_weight_specs(cls, c: ModelConfig) -> tuple[WeightSpec, ...]:
        vision, _, _ = _settings(c)
        hf = cls._hf_prefix
        proj = hf + "multi_modal_projector.linear."
        return (
            *siglip_specs(vision, hf + "vision_tower.", ("vision_tower",)),
            WeightSpec(
                ("multi_modal_projector", "weight"),
                ((proj + "weight", (c.hidden_size, vision.hidden_size)),),
            ),
            WeightSpec(("multi_modal_projector", "bias"), ((proj + "bias", (c.hidden_size,)),)),
            *gemma_specs(c, hf + "language_model.model.", ("language_model",)),
        )

    @classmethod
    def hf_weight_aliases(cls, c: ModelConfig) -> dict[str, str]:
        """Hub checkpoints (google/paligemma-*, vidore/colpali-*-hf) keep the tower's tensors
        under vision_tower.vision_model.*, where transformers 5 saves vision_tower.*."""
        tower = cls._hf_prefix + "vision_tower."
        return {
            name: tower + "vision_model." + name.removeprefix(tower)
            for spec in cls.hf_weight_specs(c)
            for name, _ in spec.sources
            if name.startswith(tower)
        }

    @staticmethod
    def hf_ignored_weight(name: str, c: ModelConfig) -> bool:
        return name.endswith("lm_head.weight") or name.endswith("rotary_emb.inv_freq")


class ColPaliForRetrieval(PaliGemmaForConditionalGeneration):
    """PaliGemma's language model without the LM head, each token's final state projected to
    embedding_dim and L2-normalised (`embed_tokens`): ColBERT-style multi-vector output. Its
    forward returns the final hidden states, as every family's does; the pooling runner's
    every-token task applies `embed_tokens` to them (runtime/runner/pooling_runner.py)."""

    _hf_prefix = "vlm."
    _prefix_is_whole_input = True

    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions()):  # noqa: B008
        super().__init__(config, options)
        dim = _embedding_dim(config)
        self.embedding_proj_layer = Linear(
            config.hidden_size, dim, bias=True, dtype=config.jnp_dtype
        )

    def embed_tokens(self, hidden_rows: jax.Array) -> jax.Array:
        """hidden_rows [R, hidden] -> float32 [R, embedding_dim], each row of unit L2 norm."""
        e = self.embedding_proj_layer(hidden_rows).astype(jnp.float32)
        return e / jnp.linalg.norm(e, axis=-1, keepdims=True)

    @classmethod
    def hf_weight_specs(cls, c: ModelConfig) -> tuple[WeightSpec, ...]:
        dim = _embedding_dim(c)
        return (
            *super().hf_weight_specs(c),
            WeightSpec(
                ("embedding_proj_layer", "weight"),
                (("embedding_proj_layer.weight", (dim, c.hidden_size)),),
            ),
            WeightSpec(("embedding_proj_layer", "bias"), (("embedding_proj_layer.bias", (dim,)),)),
        )


def _embedding_dim(config: ModelConfig) -> int:
    dim = config.hf_config.get("embedding_dim", 128)
    if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
        raise ConfigError(f"{config.path}: embedding_dim must be a positive int, got {dim!r}")
    return dim
