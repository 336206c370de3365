"""Where a model's images go in its prompt, and a prompt's images turned into placeholders.

PaliGemma (and ColPali, a PaliGemma inside) takes one image per prompt, its `num_image_tokens`
placeholder tokens first, then the text: HF's processor builds "<image> * N + BOS + prompt + \\n"
(vLLM's PaliGemma processor inserts the same tokens at the start). A text prompt is tokenized
with "\\n" appended (unless it ends with one) and the tokenizer's BOS; given token ids are used as
they are, the placeholders put before them unless they already start with exactly them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from runtime.core.request import MultiModalInput
from runtime.multimodal.image_processor import ImageError, ImageProcessorConfig, PreprocessMemo

# Architectures whose config describes a vision tower in PaliGemma's layout; the nested key that
# holds the PaliGemma config (ColPali wraps one).
_IMAGE_MODELS = {"PaliGemmaForConditionalGeneration": None, "ColPaliForRetrieval": "vlm_config"}


# Late-interaction retrievers: one embedding per token, scored by MaxSim.
_MULTI_VECTOR = frozenset({"ColPaliForRetrieval"})


def is_multi_vector(architecture: str) -> bool:
    return architecture in _MULTI_VECTOR


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """What a vision-language model takes: `max_images` images per prompt, each filling
    `num_image_tokens` placeholders of `image_token_id`, preprocessed by `processor`."""

    architecture: str
    image_token_id: int
    num_image_tokens: int
    image_size: int
    max_images: int
    processor: ImageProcessorConfig


def image_spec(architecture: str, hf_config: Mapping, path: str) -> ImageSpec | None:
    """The image inputs of a checkpoint, or None for a model that takes no images."""
    if architecture not in _IMAGE_MODELS:
        return None
    nested = _IMAGE_MODELS[architecture]
    config = hf_config[nested] if nested else hf_config
    if not isinstance(config, Mapping):
        raise ValueError(f"{path}: {architecture} config has no {nested!r} object")
    vision = config.get("vision_config") or {}
    image_size = int(vision.get("image_size", 224))
    patch = int(vision.get("patch_size", 14))
    token = config.get("image_token_index", config.get("image_token_id"))
    if token is None:
        raise ValueError(f"{path}: {architecture} config names no image_token_index")
    return ImageSpec(
        architecture=architecture,
        image_token_id=int(token),
        num_image_tokens=(image_size // patch) ** 2,
        image_size=image_size,
        # vLLM's PaliGemma limit (get_supported_mm_limits): one image per prompt.
        max_images=1,
        processor=ImageProcessorConfig.from_pretrained(path, image_size),
    )


@dataclass(frozen=True, slots=True)
class ImagePrompt:
    """A prompt's token ids with the placeholders in, its images' placeholders (hash, offset,
    count) and their pixel values, in prompt order."""

    token_ids: tuple[int, ...]
    mm_inputs: tuple[MultiModalInput, ...] = ()
    pixel_values: tuple[np.ndarray, ...] = field(default=())


def images_of(multi_modal_data: object, own: str) -> list:
    """The images of a prompt's multi_modal_data ({"image": img or [img, ...]})."""
    if not isinstance(multi_modal_data, Mapping):
        raise TypeError(
            f"{own}: multi_modal_data must be a dict like {{'image': image}}, got "
            f"{type(multi_modal_data).__name__}"
        )
    other = sorted(str(k) for k in multi_modal_data if k != "image")
    if other:
        raise ValueError(f"{own}: multi_modal_data holds {other}; only 'image' is served")
    images = multi_modal_data.get("image")
    if images is None:
        return []
    if isinstance(images, list | tuple):
        return list(images)
    return [images]


def build_image_prompt(
    spec: ImageSpec | None,
    own: str,
    token_ids: Sequence[int],
    images: list,
    memo: PreprocessMemo | None = None,
) -> ImagePrompt:
    """Placeholders for `images` in `token_ids` (a text prompt's already carry BOS and '\\n');
    `memo` holds the images its batch preprocessed so far (a one-prompt memo without it)."""
    ids = tuple(token_ids)
    if spec is None:
        if images:
            raise ValueError(f"{own}: an image was given, but this model takes no images")
        return ImagePrompt(ids)
    placeholder = spec.image_token_id
    if len(images) > spec.max_images:
        raise ValueError(
            f"{own}: {len(images)} images given, but {spec.architecture} takes at most "
            f"{spec.max_images} per prompt"
        )
    n = spec.num_image_tokens * len(images)
    leading = 0
    while leading < len(ids) and ids[leading] == placeholder:
        leading += 1
    stray = ids.count(placeholder) - leading
    if stray or (leading and leading != n):
        raise ValueError(
            f"{own}: the prompt holds {ids.count(placeholder)} image placeholder tokens "
            f"(id {placeholder}) for {len(images)} image(s); {spec.architecture} takes "
            f"{spec.num_image_tokens} per image, all at the start of the prompt"
        )
    ids = (placeholder,) * n + ids[leading:]
    if memo is None:
        memo = PreprocessMemo()
    pixels, items = [], []
    for k, image in enumerate(images):
        try:
            values, digest = memo.get(spec.processor, image, f"{own}: image {k}")
        except ImageError:
            raise
        except Exception as err:  # Pillow's own errors on a broken image
            raise ImageError(f"{own}: image {k} cannot be read ({err})") from None
        pixels.append(values)
        items.append(MultiModalInput(digest, k * spec.num_image_tokens, spec.num_image_tokens))
    return ImagePrompt(ids, tuple(items), tuple(pixels))


def prefix_salt(token_ids: Sequence[int], mm_inputs: Sequence[MultiModalInput]) -> str:
    """A prefix-cache salt naming a whole bidirectional prompt (tokens and images).

    Under PaliGemma's prefix-LM every prompt token attends to every other, so a block's KV
    depends on the prompt tokens after it too: two prompts that share their first blocks but not
    the rest must not share those blocks. The salt enters the first block's hash and so every
    later block's (runtime/core/kv/block_hash.py): a hit needs the whole prompt equal.
    """
    digest = hashlib.sha256(b"vlax.prefix-lm.v1\x00")
    digest.update(np.asarray(token_ids, np.int64).tobytes())
    for item in mm_inputs:
        digest.update(f"|{item.content_hash}@{item.offset}+{item.num_embeds}".encode())
    return digest.hexdigest()
