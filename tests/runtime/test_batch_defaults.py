"""The engine's batch limits when the user gives none: vLLM 0.33's offline-LLM defaults
(EngineArgs.get_batch_defaults and _set_default_max_num_seqs_and_batched_tokens_args), decided
once in runtime/engine_setup.py from the config, the platform and max_model_len."""

from __future__ import annotations

import pytest

from model.testing import write_tiny_checkpoint
from runtime import engine_setup
from runtime.config import ConfigError, EngineConfig


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # max_position_embeddings 8192: room for the non-chunked floor to show above 4096
    root = tmp_path_factory.mktemp("defaults")
    return write_tiny_checkpoint(root / "llama", "llama", max_position_embeddings=8192)


def limits(path, **config):
    setup = engine_setup.resolve(EngineConfig(model=path, dtype="float32", **config))
    return setup.max_num_batched_tokens, setup.config.max_num_seqs


def test_cpu_defaults_are_vllms_offline_ones(path):
    assert limits(path) == (4096, 256)
    # never more tokens than max_num_seqs whole requests
    assert limits(path, max_model_len=8) == (2048, 256)
    assert limits(path, max_model_len=8, max_num_seqs=3) == (24, 3)
    # without chunked prefill at least max_model_len, then the same cap
    assert limits(path, enable_chunked_prefill=False) == (8192, 256)
    assert limits(path, enable_chunked_prefill=False, max_model_len=5000) == (5000, 256)
    assert limits(path, enable_chunked_prefill=False, max_model_len=100) == (4096, 256)


def test_given_limits_stay_as_given(path):
    assert limits(path, max_num_seqs=7) == (4096, 7)
    assert limits(path, max_num_batched_tokens=300) == (300, 256)
    assert limits(path, max_num_batched_tokens=100000, max_num_seqs=2) == (100000, 2)
    with pytest.raises(ConfigError, match="max_num_batched_tokens=300 must be at least"):
        limits(path, max_num_batched_tokens=300, enable_chunked_prefill=False)


def test_defaults_scale_with_the_devices_and_follow_the_platform(path, monkeypatch):
    assert limits(path, tensor_parallel_size=2) == (8192, 512)
    monkeypatch.setattr(engine_setup, "current_platform", lambda: "cuda")
    assert limits(path) == (8192, 256)
    monkeypatch.setattr(engine_setup, "current_platform", lambda: "rocm")
    assert limits(path, max_model_len=16) == (4096, 256)
