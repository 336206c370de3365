"""benchmarks/embed_throughput.py: the FLOP count behind its MFU counts the checkpoint's own
matmul weights (the model is built on the meta device; nothing is run)."""

import json
import os

from benchmarks import embed_throughput as bench


def test_model_flops_count_the_encoders_own_matmul_weights():
    import torch
    import transformers

    path = bench.minilm_path()
    with open(os.path.join(path, "config.json")) as f:
        config = transformers.BertConfig(**json.load(f))
    with torch.device("meta"):
        model = transformers.BertModel(config, add_pooling_layer=False)
    layers = sum(p.numel() for n, p in model.named_parameters() if "encoder" in n and p.dim() >= 2)
    attention = config.num_hidden_layers * 4 * config.hidden_size
    lengths = [8, 131, 256]
    expected = sum(n * 2 * layers + attention * n * n for n in lengths)
    assert bench.model_flops(path, lengths) == expected
