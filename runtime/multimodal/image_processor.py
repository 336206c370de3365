"""Image preprocessing as the checkpoint's preprocessor_config.json says, with Pillow and numpy.

The steps and their order are transformers' PIL image processors' (SiglipImageProcessorPil for
PaliGemma and ColPali): convert to RGB, resize with Pillow to (height, width) with the configured
resampling filter, rescale (x * rescale_factor), normalize ((x - mean) / std), channels first.
Every value is computed in float32, as transformers does.

Each image's content hash is the sha256 of its preprocessed pixels (shape and bytes): the encoder
output depends on nothing else, so two inputs that preprocess alike share one encoder output,
and two that differ by one pixel never do.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

# transformers' defaults for the keys a preprocessor_config.json may leave out (SiglipImageProcessor).
_RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


class ImageError(ValueError):
    """An image that cannot be read or preprocessed; the message names what was given."""


@dataclass(frozen=True, slots=True)
class ImageProcessorConfig:
    height: int
    width: int
    resample: int = 3  # PIL's BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True

    @classmethod
    def from_pretrained(cls, path: str | Path, image_size: int) -> ImageProcessorConfig:
        """Read `path`/preprocessor_config.json; without one, the model's image_size square with
        transformers' SigLIP defaults (what the model was built for)."""
        file = Path(path) / "preprocessor_config.json"
        if not file.is_file():
            return cls(image_size, image_size)
        try:
            raw = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ImageError(f"{file}: not readable JSON ({err})") from None
        size = raw.get("size") or {}
        if "height" in size and "width" in size:
            height, width = int(size["height"]), int(size["width"])
        elif "shortest_edge" in size:
            height = width = int(size["shortest_edge"])
        else:
            height = width = image_size
        if (height, width) != (image_size, image_size) and raw.get("do_resize", True):
            raise ImageError(
                f"{file}: size {height}x{width}, but the vision tower takes "
                f"{image_size}x{image_size} images"
            )
        resample = int(raw.get("resample", 3))
        if resample not in _RESAMPLE_NAMES:
            raise ImageError(f"{file}: resample={resample}, expected one of {_RESAMPLE_NAMES}")
        return cls(
            height,
            width,
            resample=resample,
            do_resize=bool(raw.get("do_resize", True)),
            do_rescale=bool(raw.get("do_rescale", True)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            do_normalize=bool(raw.get("do_normalize", True)),
            image_mean=_triple(file, "image_mean", raw.get("image_mean", 0.5)),
            image_std=_triple(file, "image_std", raw.get("image_std", 0.5)),
            do_convert_rgb=bool(raw.get("do_convert_rgb", True)),
        )


def _triple(file: Path, name: str, value) -> tuple[float, float, float]:
    values = [value] * 3 if isinstance(value, int | float) else list(value)
    if len(values) != 3:
        raise ImageError(f"{file}: {name}={value!r}, expected one value or three (RGB)")
    return tuple(float(v) for v in values)


def to_pil(image: object, what: str) -> Image.Image:
    """A PIL image from a PIL image or an HxWx3 (or HxW) uint8 array; ImageError otherwise."""
    if isinstance(image, Image.Image):
        try:
            image.load()
        except Exception as err:  # a truncated or corrupt file opened lazily
            raise ImageError(f"{what}: the image cannot be read ({err})") from None
        return image
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise ImageError(
                f"{what}: an array image must be uint8 (0..255), got dtype {image.dtype}"
            )
        if image.ndim == 3 and image.shape[2] == 3 and image.shape[0] and image.shape[1]:
            return Image.fromarray(np.ascontiguousarray(image), "RGB")
        if image.ndim == 2 and image.size:
            return Image.fromarray(np.ascontiguousarray(image), "L")
        raise ImageError(f"{what}: an array image must be HxWx3 (or HxW), got shape {image.shape}")
    raise ImageError(
        f"{what}: expected a PIL.Image.Image or an HxWx3 uint8 numpy array, got "
        f"{type(image).__name__}"
    )


def preprocess(config: ImageProcessorConfig, image: object, what: str = "image") -> np.ndarray:
    """float32 [3, height, width] pixel values of one image."""
    pil = to_pil(image, what)
    if config.do_convert_rgb and pil.mode != "RGB":
        pil = _to_rgb(pil)
    if config.do_resize:
        pil = pil.resize((config.width, config.height), resample=config.resample)
    pixels = np.asarray(pil)
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ImageError(f"{what}: mode {pil.mode} is not RGB; it needs do_convert_rgb")
    if pixels.shape[:2] != (config.height, config.width):
        raise ImageError(
            f"{what}: {pixels.shape[0]}x{pixels.shape[1]} pixels, but the vision tower takes "
            f"{config.height}x{config.width} (the preprocessor config does not resize)"
        )
    out = pixels.astype(np.float32)
    if config.do_rescale:
        out = out * np.float32(config.rescale_factor)
    if config.do_normalize:
        mean = np.asarray(config.image_mean, np.float32)
        std = np.asarray(config.image_std, np.float32)
        out = (out - mean) / std
    return np.ascontiguousarray(out.transpose(2, 0, 1), np.float32)


def _to_rgb(pil: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (transformers' convert_to_rgb)."""
    if "A" in pil.getbands() or pil.info.get("transparency") is not None:
        rgba = pil.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return pil.convert("RGB")


class PreprocessMemo:
    """Each image object of one batch of prompts, preprocessed and hashed once: a picture asked
    many questions (the same object in many prompts) costs one preprocess, not one a prompt.

    Keyed by the object's identity, holding the object so no id is reused while the memo lives.
    A memo lives for one batch, read whole before any of it runs, so nothing changes an image
    between two of its prompts; a new batch starts a new memo (the caller may change its images
    between calls).
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[int, ImageProcessorConfig], tuple[object, np.ndarray, str]] = {}

    def get(self, config: ImageProcessorConfig, image: object, what: str) -> tuple[np.ndarray, str]:
        """(float32 [3, height, width] pixels, their content hash) of `image` under `config`."""
        key = (id(image), config)
        seen = self._seen.get(key)
        if seen is not None:
            return seen[1], seen[2]
        pixels = preprocess(config, image, what)
        pixels.flags.writeable = False  # shared by every prompt that gave the object
        digest = content_hash(pixels)
        self._seen[key] = (image, pixels, digest)
        return pixels, digest


def content_hash(pixels: np.ndarray) -> str:
    """The hex sha256 of preprocessed pixels (their shape first, so no two shapes collide)."""
    digest = hashlib.sha256(b"vlax.image.v1\x00")
    digest.update(repr((pixels.shape, str(pixels.dtype))).encode())
    digest.update(np.ascontiguousarray(pixels).tobytes())
    return digest.hexdigest()
