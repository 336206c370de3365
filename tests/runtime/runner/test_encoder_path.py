"""The runner's encoder path on the tiny PaliGemma: rows spliced from any offset into a
placeholder run (a step starting or ending inside an image), encodes only of what the step names,
misses named, frees applied only once a step went through, a failed step's outputs forgotten,
images kept once per content hash for as long as an admitted request holds them, and a request id
admitted again before the runner heard its old request finished."""

import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ModelConfig
from model.loader import load_model
from model.testing_multimodal import IMAGE_SIZE, NUM_IMAGE_TOKENS, write_tiny_paligemma
from runtime.core.outputs import SchedulerOutput
from runtime.core.request import MultiModalInput
from runtime.runner.encoder_path import EncoderMiss, EncoderPath
from runtime.runner.model_runner import model_options

N = NUM_IMAGE_TOKENS


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    directory = write_tiny_paligemma(tmp_path_factory.mktemp("paligemma"), seed=7)
    config = ModelConfig.from_pretrained(directory, dtype="float32")
    graphdef, params = load_model(directory, config, model_options(config, 16, "auto"))
    return EncoderPath(graphdef, params, image_size=IMAGE_SIZE, num_image_tokens=N)


def _output(**fields) -> SchedulerOutput:
    base = dict(
        step=0,
        scheduled_new_reqs=(),
        scheduled_cached_reqs=(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        scheduled_encoder_inputs={},
        free_encoder_hashes=(),
        preempted_req_ids=(),
        finished_req_ids=(),
    )
    return SchedulerOutput(**{**base, **fields})


def test_rows_from_inside_a_placeholder_run(path):
    rng = np.random.default_rng(0)
    pixels = [rng.standard_normal((3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32) for _ in "ab"]
    items = {"a": (MultiModalInput("A", 0, N),), "b": (MultiModalInput("B", 4, N),)}
    path.add_request("a", items["a"], (pixels[0],))
    path.add_request("b", items["b"], (pixels[1],))
    path.encode({"a": (0,), "b": (0,)}, items)
    assert path.num_encoded == 2
    expected = {h: np.asarray(path.outputs[h]) for h in "AB"}
    # a: tokens 5..20 (starts inside its image, ends after it); b: tokens 0..11 (ends inside).
    computed, scheduled = {"a": 5, "b": 0}, {"a": 16, "b": 12}
    embeds, mask = path.rows(["a", "b"], items, computed, scheduled, 32)
    embeds = np.asarray(embeds)
    want = np.zeros(32, bool)
    want[0:11] = True  # a's positions 5..15
    want[16 + 4 : 16 + 12] = True  # b's positions 4..11
    np.testing.assert_array_equal(mask, want)
    np.testing.assert_array_equal(embeds[0:11], expected["A"][5:16])
    np.testing.assert_array_equal(embeds[20:28], expected["B"][0:8])
    assert not embeds[~want].any()
    # The same image from the other side of a chunk boundary: b's positions 12..19.
    embeds, mask = path.rows(["b"], items, {"b": 12}, {"b": 10}, 16)
    np.testing.assert_array_equal(np.asarray(embeds)[:8], expected["B"][8:16])
    assert mask[:8].all() and not mask[8:].any()


def test_misses_frees_and_a_failed_step(path):
    with pytest.raises(EncoderMiss, match="item 0 of request 'ghost'"):
        path.encode({"ghost": (0,)}, {})
    items = {"c": (MultiModalInput("C", 0, N),)}
    path.add_request("c", items["c"], (np.zeros((3, 32, 32), np.float32),))
    with pytest.raises(EncoderMiss, match="request 'c' computes placeholder rows 0..3"):
        path.rows(["c"], items, {"c": 0}, {"c": 4}, 16)
    count = path.num_encoded
    path.encode({"c": (0,)}, items)
    path.undo_step()  # the step failed before the device ran it
    assert "C" not in path.outputs and path.num_encoded == count
    path.encode({"c": (0,)}, items)
    path.end_step(_output(free_encoder_hashes=("A",), finished_req_ids=("a",)))
    assert "A" not in path.outputs and "C" in path.outputs and "A" not in path.pixels
    with pytest.raises(ValueError, match="1 multimodal items but 0 images"):
        path.add_request("d", (MultiModalInput("D", 0, N),), ())
    # No image rows at all: zeros, nothing masked, same dtype as the outputs.
    embeds, mask = path.rows(["c"], items, {"c": N}, {"c": 1}, 16)
    assert embeds.dtype == jnp.float32 and not mask.any() and not np.asarray(embeds).any()


def test_images_are_kept_once_per_hash_while_an_admission_holds_them(path):
    rng = np.random.default_rng(1)
    image, other = (rng.standard_normal((3, 32, 32)).astype(np.float32) for _ in "io")
    shared = (MultiModalInput("S", 0, N),)
    path.add_request("p", shared, (image,))
    path.add_request("q", shared, (image.copy(),))
    path.add_request("text", (), ())  # a request without images is admitted too
    assert path.pixels["S"] is image  # one copy for both requests
    path.end_step(_output(finished_req_ids=("p", "text")))
    assert "S" in path.pixels  # q still holds it
    # The scenario that lost images: "q" finishes and its id is admitted again, with another
    # image, before the runner hears of the finish. The finish releases the old admission only.
    path.add_request("q", (MultiModalInput("O", 0, N),), (other,))
    path.end_step(_output(finished_req_ids=("q",)))
    assert "S" not in path.pixels and path.pixels["O"] is other
    count = path.num_encoded
    path.encode({"q": (0,)}, {"q": (MultiModalInput("O", 0, N),)})
    assert path.num_encoded == count + 1
    path.end_step(_output(finished_req_ids=("q",)))
    assert "O" not in path.pixels
    path.end_step(_output(finished_req_ids=("never admitted",)))  # nothing to release


def test_the_vision_batch_pads_at_most_a_fifth(path, monkeypatch):
    """The vision tower's cost is its padded batch's: 20 images ran as 32 under power-of-two
    padding (the multimodal benchmark's 20 distinct images)."""
    import runtime.runner.encoder_path as encoder_path

    batches = []
    real = encoder_path._encode

    def recording(graphdef, params, pixels):
        batches.append(pixels.shape[0])
        return real(graphdef, params, pixels)

    monkeypatch.setattr(encoder_path, "_encode", recording)
    rng = np.random.default_rng(3)
    for n, padded in ((3, 3), (9, 10), (20, 20), (33, 40)):
        hashes = [f"pad{n}-{k}" for k in range(n)]
        items = {h: (MultiModalInput(h, 0, N),) for h in hashes}
        for h in hashes:
            pixels = rng.standard_normal((3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)
            path.add_request(h, items[h], (pixels,))
        count = path.num_encoded
        path.encode({h: (0,) for h in hashes}, items)
        assert batches[-1] == padded, (n, batches)
        assert path.num_encoded == count + n
        assert all(path.outputs[h].shape == (N, path.hidden) for h in hashes)
        path.end_step(_output(finished_req_ids=tuple(hashes), free_encoder_hashes=tuple(hashes)))
