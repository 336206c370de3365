"""The tiny HF checkpoints parity tests run on carry no constant tensor: with every norm weight at
HF's initial 1.0, swapping `input_layernorm` and `post_attention_layernorm` passed every parity test."""

import numpy as np
import pytest
from safetensors.numpy import load_file

from model.testing import write_tiny_checkpoint


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_norm_weights_and_biases_are_random_and_distinct(tmp_path, arch):
    path = write_tiny_checkpoint(tmp_path, arch, attention_bias=True, mlp_bias=True)
    tensors = load_file(f"{path}/model.safetensors")
    keyed = {n: t for n, t in tensors.items() if "norm" in n or n.endswith(".bias")}
    expected = {"llama": 19, "qwen2": 11, "qwen3": 17}[arch]  # biases + norms HF has per family
    assert len(keyed) == expected, sorted(keyed)
    for name, t in tensors.items():
        assert np.unique(t).size > t.size // 2, f"{name} is (nearly) constant"
    for name, t in keyed.items():
        if "norm" in name:
            assert t.min() >= 0.5 and t.max() < 1.5, name
    # No two norms of a layer are equal, so any swap between them changes the function.
    layer0 = [t for n, t in keyed.items() if n.startswith("model.layers.0.") and "norm" in n]
    assert len(layer0) >= 2
    for i, a in enumerate(layer0):
        for b in layer0[i + 1 :]:
            assert a.shape != b.shape or not np.allclose(a, b)


def test_the_same_seed_writes_the_same_bytes(tmp_path):
    a = load_file(f"{write_tiny_checkpoint(tmp_path / 'a', 'qwen3', seed=5)}/model.safetensors")
    b = load_file(f"{write_tiny_checkpoint(tmp_path / 'b', 'qwen3', seed=5)}/model.safetensors")
    c = load_file(f"{write_tiny_checkpoint(tmp_path / 'c', 'qwen3', seed=6)}/model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["model.norm.weight"], c["model.norm.weight"])
