"""PaliGemma through LLM.generate with images: HF parity over many image sizes, aspect ratios and
prompt lengths in one engine (PR 52417: one start, every size a request, each case named when it
fails), the encoder cache end to end (one encode per distinct image, a tiny cache evicting while
requests come and go, the same-step evict-and-reallocate of #52482 with real encoder outputs), and
prefix caching keyed by the image and the whole bidirectional prompt."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from model.testing import check_logprobs_close
from model.testing_multimodal import (
    IMAGE_SIZE,
    IMAGE_TOKEN,
    NUM_IMAGE_TOKENS,
    hf_load_paligemma,
    write_tiny_paligemma,
)
from vlax import LLM, SamplingParams

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
ENGINE = dict(max_model_len=96, max_num_seqs=8, dtype="float32", record_steps=None)


def _image(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(1000 + seed).integers(3, IMAGE_TOKEN, n).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_paligemma(tmp_path_factory.mktemp("paligemma"), seed=3)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return hf_load_paligemma(checkpoint)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, **ENGINE)


def _hf_greedy(hf, text: list[int], image: np.ndarray):
    """HF's greedy tokens and top-5 logprobs: its own SigLIP processor, token_type_ids 0 over
    the image and prompt (the processor's prefix LM)."""
    pixels = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})(
        images=Image.fromarray(image), return_tensors="pt"
    )["pixel_values"]
    ids = torch.tensor([[IMAGE_TOKEN] * NUM_IMAGE_TOKENS + text])
    with torch.no_grad():
        out = hf.generate(
            ids,
            pixel_values=pixels,
            attention_mask=torch.ones_like(ids),
            token_type_ids=torch.zeros_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    top = []
    for score in out.scores:
        lp = torch.log_softmax(score[0].float(), -1).numpy()
        top.append({int(t): float(lp[t]) for t in np.argsort(-lp)[:5]})
    return tokens, top


def _ours(out):
    c = out.outputs[0]
    return c.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs]


def _request(text, image):
    return {"prompt_token_ids": text, "multi_modal_data": {"image": image}}


def test_many_image_sizes_and_prompt_lengths_match_hf_in_one_engine(llm, hf):
    cases = {
        "square 32, 3 tokens": (_image(1, 32, 32), _text(1, 3)),
        "square 200, 1 token": (_image(2, 200, 200), _text(2, 1)),
        "wide 24x90, 17 tokens": (_image(3, 24, 90), _text(3, 17)),
        "tall 120x16, 40 tokens": (_image(4, 120, 16), _text(4, 40)),
        "tiny 3x5, 9 tokens": (_image(5, 3, 5), _text(5, 9)),
        "PIL 77x41, 28 tokens": (Image.fromarray(_image(6, 77, 41)), _text(6, 28)),
    }
    outs = llm.generate(
        [_request(text, image) for image, text in cases.values()], GREEDY, use_tqdm=False
    )
    failures = []
    for (name, (image, text)), out in zip(cases.items(), outs, strict=True):
        array = np.asarray(image.convert("RGB")) if isinstance(image, Image.Image) else image
        assert out.prompt_token_ids[:NUM_IMAGE_TOKENS] == [IMAGE_TOKEN] * NUM_IMAGE_TOKENS
        try:
            ref = _hf_greedy(hf, text, array)
            assert list(out.outputs[0].token_ids) == ref[0], (out.outputs[0].token_ids, ref[0])
            check_logprobs_close([_ours(out)], [ref], atol=2e-3)
        except AssertionError as err:
            failures.append(f"{name}: {err}")
    assert not failures, failures


def test_the_same_image_in_many_requests_is_encoded_once(llm):
    path = llm.engine.runner.encoder_path
    image = _image(7, 50, 60)
    before = path.num_encoded
    first = llm.generate(
        [_request(_text(10 + k, 2 + k), image) for k in range(6)], GREEDY, use_tqdm=False
    )
    # Later requests (after the first finished) take the cached output too.
    second = llm.generate([_request(_text(20, 5), image)], GREEDY, use_tqdm=False)
    assert path.num_encoded - before == 1
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in first + second)


def test_prefix_cache_hits_need_the_same_image_and_the_same_text(llm):
    image_a, image_b = _image(30, 40, 40), _image(31, 40, 40)
    text = _text(30, 20)  # 16 image tokens + 20: two full 16-token blocks
    (first,) = llm.generate([_request(text, image_a)], GREEDY, use_tqdm=False)

    def hit(prompt):
        start = len(llm.engine.history)
        out = llm.generate([prompt], GREEDY, use_tqdm=False)
        news = [n for so in llm.engine.history[start:] for n in so.scheduled_new_reqs]
        return news[0].num_computed_tokens, out[0]

    other_image, _ = hit(_request(text, image_b))
    other_tail, _ = hit(_request(text[:-1] + [3 if text[-1] != 3 else 4], image_a))
    same, same_out = hit(_request(text, image_a))
    assert (other_image, other_tail) == (0, 0)
    assert same == 32
    assert same_out.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_tiny_encoder_cache_gives_the_same_tokens_and_frees_only_what_is_gone(checkpoint, llm):
    """Room for two images (32 embeddings): six images, twice, evict all the time.
    Then #52482's step: X and Y freeable; c's Z evicts X and d re-allocates X, evicting Y, in one
    step. Only Y may be freed, and d's tokens must come from X's real encoder output."""
    images = [_image(40 + k, 30 + 7 * k, 50 - 3 * k) for k in range(6)]
    prompts = [_request(_text(40 + k, 3 + k), images[k % 6]) for k in range(12)]
    roomy = llm.generate(prompts, GREEDY, use_tqdm=False)
    tiny = LLM(checkpoint, **ENGINE, encoder_cache_size=32, encoder_compute_budget=32)
    # Two batches: the second brings back the images the first evicted.
    outs = tiny.generate(prompts[:6], GREEDY, use_tqdm=False)
    outs += tiny.generate(prompts[6:], GREEDY, use_tqdm=False)
    failures = [
        f"request {k}: {a.outputs[0].token_ids} != {b.outputs[0].token_ids}"
        for k, (a, b) in enumerate(zip(outs, roomy, strict=True))
        if a.outputs[0].token_ids != b.outputs[0].token_ids
    ]
    assert not failures, failures
    path = tiny.engine.runner.encoder_path
    assert path.num_encoded >= 10  # evicted outputs were encoded again
    assert len(path.outputs) <= 2

    x, y, z = _image(50, 32, 32), _image(51, 32, 32), _image(52, 32, 32)
    tiny.generate([_request(_text(50, 4), x), _request(_text(51, 4), y)], GREEDY, use_tqdm=False)
    state = tiny.engine.state
    assert len(state.encoder.freeable) == 2
    hash_x, hash_y = state.encoder.freeable  # LRU order: X first
    start = len(tiny.engine.history)
    late = tiny.generate(
        [_request(_text(52, 6), z), _request(_text(53, 6), x)], GREEDY, use_tqdm=False
    )
    step = tiny.engine.history[start]
    assert step.free_encoder_hashes == (hash_y,)
    assert len(step.scheduled_encoder_inputs) == 2
    assert set(path.outputs) == {hash_x} | set(tiny.engine.state.encoder.entries)
    reference = llm.generate(
        [_request(_text(52, 6), z), _request(_text(53, 6), x)], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in late] == [o.outputs[0].token_ids for o in reference]


def test_image_errors_name_the_request(checkpoint, llm):
    good = _image(60, 8, 8)
    cases = {
        "two images": (
            {"prompt_token_ids": [5], "multi_modal_data": {"image": [good, good]}},
            "2 images given, but PaliGemmaForConditionalGeneration takes at most 1",
        ),
        "unreadable": (
            {"prompt_token_ids": [5], "multi_modal_data": {"image": np.zeros((4, 4), np.float64)}},
            "an array image must be uint8",
        ),
    }
    for name, (prompt, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt], GREEDY, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests(), name
    # An encoder output larger than the whole encoder cache could never be encoded: refused
    # before anything runs (no step is taken, so this engine compiles nothing).
    small = LLM(checkpoint, **ENGINE, encoder_cache_size=8)
    with pytest.raises(ValueError, match="image 0's encoder output is 16 embeddings, more than "):
        small.generate([_request([5, 6], good)], GREEDY, use_tqdm=False)
    assert not small.engine.has_unfinished_requests() and small.engine.totals.steps == 0


def test_a_request_id_reused_before_the_runner_hears_it_finished_keeps_its_image(llm):
    """x finishes in a step; x is added again with another image at once, and waits behind
    requests holding every slot. The next step tells the runner the old x finished: that must not
    drop the new x's image (the runner kept images by request id and lost it: EncoderMiss when
    the new x was scheduled). Images are kept once per content hash while a request holds them."""
    engine = llm.engine
    path = engine.runner.encoder_path

    def add(request_id, text, image, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        own = f"request {request_id!r}"
        prompt, built = engine.input_processor.image_prompt(_request(text, image), own)
        engine.add_processed(
            [
                engine.process_request(
                    request_id, built.token_ids, params, prompt=prompt, images=built
                )
            ]
        )

    engine.step()  # nothing to run: the runner hears of earlier requests' last finishes
    assert path.pixels == {}
    shared, old, new = _image(70, 20, 30), _image(71, 30, 20), _image(72, 25, 25)
    add("x", _text(70, 4), old, 1)
    for k in range(ENGINE["max_num_seqs"]):
        add(f"b{k}", _text(71 + k, 3), shared, 4)
    assert len(path.pixels) == 2  # eight requests show one image: kept once
    finished = {o.request_id: o for o in engine.step()}
    assert "x" in finished  # and its finish reaches the runner with the next step
    add("x", _text(80, 5), new, NEW_TOKENS)
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step())
    (reference,) = llm.generate([_request(_text(80, 5), new)], GREEDY, use_tqdm=False)
    assert finished["x"].outputs[0].token_ids == reference.outputs[0].token_ids
    engine.step()  # nothing to run: the runner hears of the last finishes
    assert path.pixels == {}
