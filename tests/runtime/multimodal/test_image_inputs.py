"""Image inputs before the core: preprocessing against transformers' SigLIP PIL processor, content
hashes, placeholders and their errors, and the prefix-cache keys an image puts on its blocks."""

import io
import json

import numpy as np
import pytest
from PIL import Image
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from runtime.core.kv.block_hash import extend_block_hashes
from runtime.core.request import Request
from runtime.core.scheduling.scheduler_state import hash_extras
from runtime.multimodal.image_processor import (
    ImageError,
    ImageProcessorConfig,
    PreprocessMemo,
    content_hash,
    preprocess,
)
from runtime.multimodal.image_prompt import (
    ImageSpec,
    build_image_prompt,
    image_spec,
    images_of,
    prefix_salt,
)

SIZE = 32
IMAGE_TOKEN = 128
N = 16  # (32 // 8) ** 2


def _spec(tmp_path=None) -> ImageSpec:
    config = {
        "architectures": ["PaliGemmaForConditionalGeneration"],
        "image_token_index": IMAGE_TOKEN,
        "vision_config": {"image_size": SIZE, "patch_size": 8},
    }
    return image_spec(config["architectures"][0], config, str(tmp_path or "/nonexistent"))


def test_preprocessing_matches_transformers_for_many_sizes_and_modes():
    rng = np.random.default_rng(0)
    hf = SiglipImageProcessorPil(size={"height": SIZE, "width": SIZE})
    config = ImageProcessorConfig(SIZE, SIZE)
    failures = []
    cases = {
        "square 64": (64, 64),
        "wide 20x50": (20, 50),
        "tall 100x7": (100, 7),
        "exact 32": (32, 32),
        "tiny 1x1": (1, 1),
        "large 333x517": (333, 517),
    }
    for name, (h, w) in cases.items():
        array = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        for kind, image in {
            "array": array,
            "RGB": Image.fromarray(array),
            "L": Image.fromarray(array[..., 0], "L"),
            "RGBA": Image.fromarray(np.dstack([array, array[..., :1]]), "RGBA"),
        }.items():
            ref = hf(
                images=image if kind != "array" else Image.fromarray(array), return_tensors="np"
            )
            mine = preprocess(config, image)
            if mine.shape != (3, SIZE, SIZE) or mine.dtype != np.float32:
                failures.append(f"{name}/{kind}: shape {mine.shape} {mine.dtype}")
            elif not np.allclose(mine, ref["pixel_values"][0], atol=1e-6, rtol=0):
                err = np.abs(mine - ref["pixel_values"][0]).max()
                failures.append(f"{name}/{kind}: max error {err}")
    assert not failures, failures


def test_preprocessor_config_json_is_followed(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "SiglipImageProcessor",
                "size": {"height": SIZE, "width": SIZE},
                "resample": 2,
                "rescale_factor": 0.5 / 255,
                "image_mean": [0.1, 0.2, 0.3],
                "image_std": [0.4, 0.5, 0.6],
            }
        )
    )
    config = ImageProcessorConfig.from_pretrained(tmp_path, SIZE)
    hf = SiglipImageProcessorPil(
        size={"height": SIZE, "width": SIZE},
        resample=2,
        rescale_factor=0.5 / 255,
        image_mean=[0.1, 0.2, 0.3],
        image_std=[0.4, 0.5, 0.6],
    )
    array = np.random.default_rng(1).integers(0, 256, (45, 61, 3), dtype=np.uint8)
    ref = hf(images=Image.fromarray(array), return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(preprocess(config, array), ref, atol=1e-6, rtol=0)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"size": {"height": 64, "width": 64}})
    )
    with pytest.raises(ImageError, match="size 64x64, but the vision tower takes 32x32"):
        ImageProcessorConfig.from_pretrained(tmp_path, SIZE)


def test_content_hash_follows_the_pixels():
    config = ImageProcessorConfig(SIZE, SIZE)
    array = np.random.default_rng(2).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    as_array = content_hash(preprocess(config, array))
    assert as_array == content_hash(preprocess(config, Image.fromarray(array)))
    changed = array.copy()
    changed[0, 0, 0] ^= 0xFF
    assert content_hash(preprocess(config, changed)) != as_array


def test_placeholders_go_first_with_their_hash_and_offset():
    spec = _spec()
    array = np.zeros((10, 20, 3), np.uint8)
    built = build_image_prompt(spec, "request '0'", [2, 5, 6], [array])
    assert built.token_ids == (IMAGE_TOKEN,) * N + (2, 5, 6)
    (item,) = built.mm_inputs
    assert (item.offset, item.num_embeds) == (0, N)
    assert item.content_hash == content_hash(built.pixel_values[0])
    # Ids that already carry exactly the placeholders are kept as they are.
    again = build_image_prompt(spec, "request '1'", built.token_ids, [array])
    assert again.token_ids == built.token_ids and again.mm_inputs == built.mm_inputs
    # No image: the ids as given.
    assert build_image_prompt(spec, "r", [2, 5], []).token_ids == (2, 5)


def test_bad_image_inputs_are_refused_naming_the_request():
    spec = _spec()
    good = np.zeros((8, 8, 3), np.uint8)
    cases = {
        "too many images": (
            lambda: build_image_prompt(spec, "request '7'", [2], [good, good]),
            "request '7': 2 images given, but PaliGemmaForConditionalGeneration takes at most 1",
        ),
        "placeholders without an image": (
            lambda: build_image_prompt(spec, "request '7'", [IMAGE_TOKEN] * N + [2], []),
            f"holds {N} image placeholder tokens \\(id {IMAGE_TOKEN}\\) for 0 image",
        ),
        "wrong placeholder count": (
            lambda: build_image_prompt(spec, "request '7'", [IMAGE_TOKEN] * 3 + [2], [good]),
            f"takes {N} per image, all at the start",
        ),
        "placeholder in the text": (
            lambda: build_image_prompt(spec, "request '7'", [2, IMAGE_TOKEN], [good]),
            "all at the start of the prompt",
        ),
        "float array": (
            lambda: build_image_prompt(spec, "r", [2], [good.astype(np.float32)]),
            "image 0: an array image must be uint8",
        ),
        "wrong array shape": (
            lambda: build_image_prompt(spec, "r", [2], [np.zeros((4, 4, 4), np.uint8)]),
            "must be HxWx3",
        ),
        "not an image": (
            lambda: build_image_prompt(spec, "r", [2], ["cat.png"]),
            "expected a PIL.Image.Image or an HxWx3 uint8 numpy array, got str",
        ),
        "an image for a text-only model": (
            lambda: build_image_prompt(None, "request '3'", [2], [good]),
            "request '3': an image was given, but this model takes no images",
        ),
        "not a dict": (lambda: images_of([good], "request '4'"), "must be a dict"),
        "video": (lambda: images_of({"video": good}, "request '4'"), "only 'image' is served"),
    }
    failures = []
    for name, (call, message) in cases.items():
        try:
            call()
            failures.append(f"{name}: no error")
        except (ValueError, TypeError) as err:
            if not __import__("re").search(message, str(err)):
                failures.append(f"{name}: {err}")
    assert not failures, failures


def test_an_unreadable_image_file_is_refused():
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(buffer, "PNG")
    truncated = Image.open(io.BytesIO(buffer.getvalue()[:60]))  # header only: decoded lazily
    with pytest.raises(ImageError, match="request '9': image 0: the image cannot be read"):
        build_image_prompt(_spec(), "request '9'", [2], [truncated])


def test_block_hashes_take_the_image_and_the_whole_prompt():
    """Same text with different images: no block in common. Same image and text: all blocks.
    Under the prefix-LM salt, a prompt that differs only after the first block shares none."""
    spec = _spec()
    rng = np.random.default_rng(3)
    a, b = (rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(2))

    def hashes(image, text):
        built = build_image_prompt(spec, "r", text, [image])
        salt = prefix_salt(built.token_ids, built.mm_inputs)
        request = Request("r", built.token_ids, mm_inputs=built.mm_inputs, cache_salt=salt)
        return extend_block_hashes((), request.prompt_token_ids, 8, hash_extras(request))

    text = list(range(1, 17))
    first = hashes(a, text)
    assert len(first) == 4
    assert first == hashes(a.copy(), text)
    assert not set(first) & set(hashes(b, text))
    assert not set(first) & set(hashes(a, text[:-1] + [99]))


def test_a_picture_in_many_prompts_of_a_batch_is_preprocessed_once(monkeypatch):
    """One memo per batch: the same image object in several prompts is preprocessed and hashed
    once, and every prompt gets the same pixels and hash as preprocessing it alone gives; another
    object with the same content is preprocessed again and hashes alike."""
    import runtime.multimodal.image_processor as image_processor

    spec = _spec()
    rng = np.random.default_rng(5)
    picture = rng.integers(0, 256, (30, 50, 3), dtype=np.uint8)
    calls = []
    real = image_processor.preprocess

    def counting(config, image, what="image"):
        calls.append(what)
        return real(config, image, what)

    monkeypatch.setattr(image_processor, "preprocess", counting)
    memo = PreprocessMemo()
    built = [build_image_prompt(spec, f"request '{k}'", [2, 7], [picture], memo) for k in range(4)]
    assert calls == ["request '0': image 0"]
    alone = real(spec.processor, picture)
    for b in built:
        np.testing.assert_array_equal(b.pixel_values[0], alone)
        assert b.mm_inputs[0].content_hash == content_hash(alone)
    copy = build_image_prompt(spec, "request '4'", [2], [picture.copy()], memo)
    assert len(calls) == 2 and copy.mm_inputs == built[0].mm_inputs
    # Without a memo, each call preprocesses.
    build_image_prompt(spec, "request '5'", [2], [picture])
    assert len(calls) == 3
