"""benchmarks/multimodal_throughput.py: its model is the ~50M-parameter PaliGemma with 64 image
tokens its docstring describes, and its workload is seeded (nothing is run; the model is built on
the meta device)."""

import numpy as np

from benchmarks import multimodal_throughput as bench


def test_model_size_image_tokens_and_seeded_workload():
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
        model = transformers.PaliGemmaForConditionalGeneration(config)
    params = sum(p.numel() for p in model.parameters())
    assert 45e6 < params < 55e6, params
    assert config.text_config.num_image_tokens == bench.NUM_IMAGE_TOKENS == 64
    images, prompts = bench.workload(200, 20, seed=0)
    again, same = bench.workload(200, 20, seed=0)
    assert prompts == same and all(np.array_equal(a, b) for a, b in zip(images, again, strict=True))
    assert len(images) == 20 and len({i for i, _ in prompts}) == 20
    assert {len(t) for _, t in prompts} == {bench.TEXT_TOKENS}
    assert all(3 <= t < bench.IMAGE_TOKEN for _, text in prompts for t in text)
