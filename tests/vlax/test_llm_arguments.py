"""`LLM`'s own arguments, as a newcomer (often coming from vLLM) gets them wrong."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from runtime.config import ConfigError
from vlax import LLM, SamplingParams
from vlax.default_model import default_model_path

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SMALL = dict(max_model_len=64, max_num_seqs=2)


@pytest.fixture(scope="module")
def float16_path(tmp_path_factory):
    """The embedded default checkpoint with its weights stored, and declared, in float16."""
    path = tmp_path_factory.mktemp("f16") / "checkpoint"
    shutil.copytree(default_model_path(tmp_path_factory.mktemp("cache")), path)
    weights = load_file(path / "model.safetensors")
    save_file({k: v.astype(np.float16) for k, v in weights.items()}, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = "float16"
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def llm(float16_path):
    return LLM(float16_path, dtype="auto", **SMALL)


def test_vllm_keyword_vlax_lacks_names_the_vlax_equivalents(float16_path):
    with pytest.raises(
        TypeError,
        match=r"LLM\(\) got an unexpected keyword argument 'gpu_memory_utilization' "
        r"\(vlax sizes the KV cache with kv_cache_bytes or num_kv_blocks\)",
    ):
        LLM(float16_path, gpu_memory_utilization=0.9)


def test_misspelt_keyword_names_the_nearest_accepted_ones(float16_path):
    with pytest.raises(
        TypeError, match=r"keyword argument 'max_num_seq'; did you mean 'max_num_seqs'"
    ):
        LLM(float16_path, max_num_seq=4)


def test_keyword_with_no_near_name_lists_every_accepted_one(float16_path):
    with pytest.raises(TypeError, match=r"'swap_space'; accepted: .*block_size, .*max_num_seqs, "):
        LLM(float16_path, swap_space=4)


def test_more_devices_than_there_are_is_refused_with_the_numbers(float16_path):
    with pytest.raises(
        ConfigError, match=r"tensor_parallel_size=2 needs 2 devices .* this process has 1 \(cpu"
    ):
        LLM(float16_path, tensor_parallel_size=2)


def test_model_path_that_does_not_exist_says_so(tmp_path):
    with pytest.raises(ConfigError, match=r"model '.*/absent' does not exist") as err:
        LLM(str(tmp_path / "absent"))
    assert "config.json" not in str(err.value)
    file = tmp_path / "config.json"
    file.write_text("{}")
    with pytest.raises(ConfigError, match=r"model '.*config.json' is a file"):
        LLM(str(file))


def test_dict_for_sampling_params_is_a_clear_type_error(llm):
    with pytest.raises(
        TypeError,
        match=r"sampling_params must be a SamplingParams, not a dict: "
        r"write SamplingParams\(\*\*\{'temperature': 0\}\)",
    ):
        llm.generate(["Hello"], {"temperature": 0}, use_tqdm=False)
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams, got dict"):
        llm.generate(["a", "b"], [GREEDY, {"temperature": 0}], use_tqdm=False)
    # Nothing was admitted: the engine serves the next call.
    out = llm.generate(["Hello"], GREEDY, use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 6


def test_float16_by_name_serves_what_auto_serves_for_a_float16_checkpoint(llm, float16_path):
    by_name = LLM(float16_path, dtype="float16", **SMALL)
    assert llm.engine.model_config.dtype == by_name.engine.model_config.dtype == "float16"
    prompts = ["Hello", "The capital of France is"]
    auto_out = llm.generate(prompts, GREEDY, use_tqdm=False)
    name_out = by_name.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in name_out] == [o.outputs[0].token_ids for o in auto_out]


def test_a_bad_checkpoint_config_raises_the_one_config_error(tmp_path):
    # model/config.py used to define a ConfigError of its own, which `except ConfigError` with
    # runtime.config's class (the one vlax documents) did not catch.
    (tmp_path / "config.json").write_text("not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(str(tmp_path))


def test_a_scheduler_limit_the_core_rejects_raises_the_one_config_error(float16_path):
    # The pure core raises SchedulerConfigError; the engine turns it into ConfigError.
    with pytest.raises(ConfigError, match="max_num_batched_tokens=4 is below max_num_seqs=8"):
        LLM(float16_path, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=4)
