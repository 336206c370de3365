"""benchmarks/multimodal_throughput.py: its model is the ~50M-parameter PaliGemma with 64 image
tokens its docstring describes, and its workload is seeded (nothing is run; the model is built on
the meta device)."""

import numpy as np
import pytest

from benchmarks import multimodal_throughput as bench


@pytest.fixture(scope="module")
def model():
    import torch
    import transformers

    config = transformers.PaliGemmaConfig(
        vision_config=bench.VISION,
        text_config=bench.TEXT,
        image_token_index=bench.IMAGE_TOKEN,
        vocab_size=bench.VOCAB,
        projection_dim=bench.TEXT["hidden_size"],
    )
    with torch.device("meta"):
        return transformers.PaliGemmaForConditionalGeneration(config)


def test_model_size_image_tokens_and_seeded_workload(model):
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    assert 45e6 < params < 55e6, params
    assert config.text_config.num_image_tokens == bench.NUM_IMAGE_TOKENS == 64
    images, prompts = bench.workload(200, 20, seed=0)
    again, same = bench.workload(200, 20, seed=0)
    assert prompts == same and all(np.array_equal(a, b) for a, b in zip(images, again, strict=True))
    assert len(images) == 20 and len({i for i, _ in prompts}) == 20
    assert {len(t) for _, t in prompts} == {bench.TEXT_TOKENS}
    assert all(3 <= t < bench.IMAGE_TOKEN for _, text in prompts for t in text)


def test_model_flops_count_the_models_own_matmul_weights(model):
    """The FLOP counts behind the JSON's MFU: 2 FLOPs per matmul weight per token (the model's own
    weights, counted from its modules) plus attention's QK and PV."""
    matrices = {n: p.numel() for n, p in model.named_parameters() if p.dim() >= 2}
    vision = sum(v for n, v in matrices.items() if "vision_tower" in n and "position" not in n)
    projector = sum(v for n, v in matrices.items() if "multi_modal_projector" in n)
    layers = sum(v for n, v in matrices.items() if "language_model.layers" in n)
    n, h = bench.NUM_IMAGE_TOKENS, bench.VISION["hidden_size"]
    attention = bench.VISION["num_hidden_layers"] * 4 * h * n * n
    assert bench.vision_flops() == 2 * n * (vision + projector) + attention
    prompt, new = n + bench.TEXT_TOKENS, bench.NEW_TOKENS
    width = bench.TEXT["num_attention_heads"] * bench.TEXT["head_dim"]
    keys = prompt * prompt + sum(range(prompt + 1, prompt + new))
    head = 2 * bench.TEXT["hidden_size"] * bench.VOCAB
    expected = (prompt + new - 1) * 2 * layers + 4 * width * keys * bench.TEXT["num_hidden_layers"]
    assert bench.text_flops(prompt, new) == expected + new * head
