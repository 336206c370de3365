"""The runner serves any family the registry knows, through the model protocol alone, and takes the
kernel choices the family made once when it was built."""

import ast
import pathlib

import numpy as np
import pytest

import runtime.runner
from model import registry
from model.base import paged_kv_spec
from model.llama import LlamaForCausalLM
from model.testing import (
    TINY_COMMON,
    hf_greedy,
    hf_load,
    randomize_constant_parameters,
    write_tiny_checkpoint,
)
from pallas_kernels.backends import BackendError
from runtime.core.request import SamplingParams
from vlax import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class MistralForCausalLM(LlamaForCausalLM):
    """A family the project does not ship, registered by this test. Mistral has Llama's layout; this
    family keeps one K/V pool per layer, so the runner must size and pass pools it was not told of."""

    @classmethod
    def cache_specs(cls, config, options):
        return tuple(
            paged_kv_spec(
                1,
                options.block_size,
                config.num_key_value_heads,
                config.head_dim,
                options.resolve_cache_dtype(config),
                name=f"layer {i} K/V",
            )
            for i in range(config.num_hidden_layers)
        )


def _write_mistral(path) -> str:
    import torch
    import transformers

    config = transformers.MistralConfig(**TINY_COMMON, sliding_window=None)
    torch.manual_seed(5)
    model = transformers.MistralForCausalLM(config)
    randomize_constant_parameters(model, 5)
    model.eval().save_pretrained(str(path), safe_serialization=True)
    return str(path)


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, n).tolist() for n in lengths]


@pytest.fixture
def mistral(tmp_path):
    registry.register("MistralForCausalLM", MistralForCausalLM, ("generate",))
    try:
        yield _write_mistral(tmp_path / "mistral")
    finally:
        registry.unregister("MistralForCausalLM")


def test_a_family_registered_from_outside_is_served_with_its_own_pools(mistral, logger_messages):
    prompts = _prompts(1, [4, 13, 7])
    with logger_messages("runtime.runner.model_runner") as log:
        llm = LLM(
            mistral,
            dtype="float32",
            max_model_len=64,
            max_num_seqs=4,
            block_size=8,
            kv_cache_bytes=1 << 16,
        )
    runner = llm.engine.runner
    assert [s.name for s in runner.cache_specs] == ["layer 0 K/V", "layer 1 K/V"]
    # 2 pools x (k, v) x 8 tokens x 2 kv heads x 16 dims x 4 bytes = 4096 bytes per block; one
    # pool alone would have been 2048.
    assert runner.num_kv_blocks == (1 << 16) // 4096
    (line,) = [m for m in log.records if m.startswith("KV cache:")]
    assert "layer 0 K/V 32768 bytes" in line and "layer 1 K/V 32768 bytes" in line

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    hf = hf_load(mistral)
    assert type(hf).__name__ == "MistralForCausalLM"
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]


def test_unregistered_family_is_refused_by_name(tmp_path):
    path = _write_mistral(tmp_path / "mistral")
    with pytest.raises(ValueError, match=r"unsupported architecture.*MistralForCausalLM"):
        LLM(path, dtype="float32", max_model_len=64)


def test_the_runner_imports_no_model_family():
    families = {
        entry.target.partition(":")[0]
        for name in registry.supported_architectures()
        if isinstance((entry := registry.lookup(name)).target, str)
    }
    assert "model.llama" in families
    runner_dir = pathlib.Path(runtime.runner.__file__).parent
    for file in runner_dir.glob("*.py"):
        tree = ast.parse(file.read_text())
        imported = {
            node.module if isinstance(node, ast.ImportFrom) else alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        assert not imported & families, (file.name, imported & families)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llama") / "ck", "llama", seed=3)


def test_attention_backend_is_decided_once_with_its_reason(llama, logger_messages):
    with logger_messages("pallas_kernels.backends") as log:
        llm = LLM(llama, dtype="float32", max_model_len=64, max_num_seqs=4, block_size=4)
        # Prompts of several lengths: several padded batch shapes, so several traces of the step.
        for lengths in ([3], [9, 20, 2], [33]):
            prompts = [{"prompt_token_ids": p} for p in _prompts(2, lengths)]
            llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(llm.engine.runner.builder._seen_shapes) > 1
    decisions = [m for m in log.records if "ragged_paged_attention" in m]
    assert decisions == [
        "backend: ragged_paged_attention -> reference [rejected pallas: platform 'cpu' not "
        "served (serves ['cuda', 'rocm'])]"
    ]
    choice = llm.engine.runner.backends["ragged_paged_attention"]
    assert (choice.impl, choice.forced) == ("reference", False)


def test_forced_backend_is_logged_as_forced(llama, logger_messages):
    with logger_messages("pallas_kernels.backends") as log:
        llm = LLM(
            llama,
            dtype="float32",
            max_model_len=64,
            max_num_seqs=2,
            block_size=4,
            attention_backend="pallas",
        )
    assert log.records == [
        "backend: ragged_paged_attention -> pallas (interpret mode) [forced by configuration]"
    ]
    assert llm.engine.runner.backends["ragged_paged_attention"].interpret


def test_an_override_that_cannot_be_served_fails_when_the_engine_is_built(llama):
    with pytest.raises(BackendError) as e:
        LLM(llama, dtype="float32", max_model_len=256, block_size=256, attention_backend="pallas")
    msg = str(e.value)
    assert "attention_backend='pallas' for LlamaForCausalLM at block_size=256" in msg
    assert (
        "implementation 'pallas' cannot serve this call: block_size 256 not a power of two" in msg
    )
