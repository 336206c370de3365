"""ColPali through LLM.embed and LLM.score: per-token embeddings of page images and text queries
against HF's ColPaliForRetrieval (cosine >= 0.999 per token, every input in one engine), and the
late-interaction MaxSim score against HF's embeddings."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from model.testing_multimodal import (
    IMAGE_SIZE,
    IMAGE_TOKEN,
    NUM_IMAGE_TOKENS,
    hf_load_colpali,
    write_tiny_paligemma,
)
from vlax import LLM


def _image(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(2000 + seed).integers(3, IMAGE_TOKEN, n).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_paligemma(tmp_path_factory.mktemp("colpali"), colpali=True, seed=5)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, max_model_len=96, max_num_seqs=8, dtype="float32")


def _hf_embed(hf, text: list[int], image: np.ndarray | None) -> np.ndarray:
    kwargs = {}
    ids = text
    if image is not None:
        ids = [IMAGE_TOKEN] * NUM_IMAGE_TOKENS + text
        kwargs["pixel_values"] = SiglipImageProcessorPil(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        )(images=Image.fromarray(image), return_tensors="pt")["pixel_values"]
    ids = torch.tensor([ids])
    with torch.no_grad():
        out = hf(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            token_type_ids=torch.zeros_like(ids),
            **kwargs,
        )
    return out.embeddings[0].numpy()


CASES = {
    "page 32x32, 4 tokens": (_image(1, 32, 32), _text(1, 4)),
    "page 300x180, 12 tokens": (_image(2, 300, 180), _text(2, 12)),
    "page 9x70, 1 token": (_image(3, 9, 70), _text(3, 1)),
    "query, 7 tokens": (None, _text(4, 7)),
    "query, 30 tokens": (None, _text(5, 30)),
}


def _prompt(image, text):
    if image is None:
        return {"prompt_token_ids": text}
    return {"prompt_token_ids": text, "multi_modal_data": {"image": image}}


def test_token_embeddings_match_hf_for_pages_and_queries(llm, checkpoint):
    hf = hf_load_colpali(checkpoint)
    outs = llm.embed([_prompt(i, t) for i, t in CASES.values()], use_tqdm=False)
    failures = []
    for (name, (image, text)), out in zip(CASES.items(), outs, strict=True):
        ours = np.asarray(out.outputs.embedding)
        theirs = _hf_embed(hf, text, image)
        if ours.shape != theirs.shape:
            failures.append(f"{name}: shape {ours.shape} vs HF {theirs.shape}")
            continue
        cosine = np.sum(ours * theirs, -1) / (
            np.linalg.norm(ours, axis=-1) * np.linalg.norm(theirs, axis=-1)
        )
        if cosine.min() < 0.999:
            failures.append(f"{name}: min cosine {cosine.min():.5f} at token {cosine.argmin()}")
    assert not failures, failures


def test_max_sim_scores_queries_against_pages(llm, checkpoint):
    hf = hf_load_colpali(checkpoint)
    pages = [(image, text) for image, text in CASES.values() if image is not None]
    query = _text(9, 6)
    scores = llm.score(
        {"prompt_token_ids": query}, [_prompt(i, t) for i, t in pages], use_tqdm=False
    )
    q = _hf_embed(hf, query, None)
    expected = [float((q @ _hf_embed(hf, t, i).T).max(axis=1).sum()) for i, t in pages]
    np.testing.assert_allclose([s.outputs.score for s in scores], expected, atol=2e-3)


def test_an_image_on_a_text_only_model_is_refused(tmp_path_factory):
    from model.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=1)
    llm = LLM(path, max_model_len=64, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"request '0': multi_modal_data holds 1 image\(s\), but "):
        llm.generate([_prompt(_image(0, 8, 8), [5, 6])], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
