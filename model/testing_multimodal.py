"""Test helpers for the multimodal families: tiny random PaliGemma and ColPali checkpoints (the
configs of shared/reference/environment.md §2) and their HF transformers oracles.

torch and transformers are imported inside the functions so model/ never needs them at import time.
"""

from __future__ import annotations

import os

# SigLIP tower: 32x32 images in 8x8 patches -> 16 image tokens.
VISION_TINY = dict(
    model_type="siglip_vision_model",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
    vision_use_head=False,
    projection_dim=64,
)
# Gemma language model; image token 128 is the last row of the vocabulary.
GEMMA_TINY = dict(
    model_type="gemma",
    vocab_size=129,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
IMAGE_TOKEN = 128
NUM_IMAGE_TOKENS = 16
IMAGE_SIZE = 32


def paligemma_config(*, vision: dict | None = None, text: dict | None = None):
    import transformers

    return transformers.PaliGemmaConfig(
        vision_config={**VISION_TINY, **(vision or {})},
        text_config={**GEMMA_TINY, **(text or {})},
        image_token_index=IMAGE_TOKEN,
        vocab_size=GEMMA_TINY["vocab_size"],
        projection_dim=(text or {}).get("hidden_size", GEMMA_TINY["hidden_size"]),
    )


def write_tiny_paligemma(
    directory: str | os.PathLike,
    *,
    colpali: bool = False,
    seed: int = 0,
    embedding_dim: int = 32,
    scale: float = 0.1,
    **config,
) -> str:
    """Save a random-weight PaliGemmaForConditionalGeneration (or, with `colpali`, a
    ColPaliForRetrieval around one) as safetensors. Every parameter is drawn from N(0, scale^2)
    (norm weights and biases too, so a swapped or dropped one changes the output)."""
    import torch
    import transformers

    cfg = paligemma_config(**config)
    torch.manual_seed(seed)
    if colpali:
        model = transformers.ColPaliForRetrieval(
            transformers.ColPaliConfig(vlm_config=cfg, embedding_dim=embedding_dim)
        )
    else:
        model = transformers.PaliGemmaForConditionalGeneration(cfg)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(scale * torch.randn(p.shape, generator=generator, dtype=torch.float32))
    model.eval().save_pretrained(os.fspath(directory), safe_serialization=True)
    # The image preprocessing the checkpoint asks for (SigLIP: resize to image_size, 1/255,
    # mean = std = 0.5), as a hub checkpoint's preprocessor_config.json gives it.
    size = cfg.vision_config.image_size
    transformers.SiglipImageProcessor(size={"height": size, "width": size}).save_pretrained(
        os.fspath(directory)
    )
    return os.fspath(directory)


def hf_load_paligemma(path: str):
    import torch
    import transformers

    return transformers.PaliGemmaForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    ).eval()


def hf_load_colpali(path: str):
    import torch
    import transformers

    return transformers.ColPaliForRetrieval.from_pretrained(path, dtype=torch.float32).eval()
