"""A checkpoint's generation_config.json through LLM: its sampling defaults apply where no
SamplingParams is given, and every EOS id it lists stops a request and is held back by min_tokens
(the core's stop check and the sampler's mask read the same set)."""

import json
import pathlib

import pytest

from model.testing import write_tiny_checkpoint
from vlax import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [1, 20, 21, 22]}, {"prompt_token_ids": [1, 30, 31]}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = pathlib.Path(write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama"))
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    # config.json's EOS is 2; the generation config adds 7, as Llama 3 adds <|eot_id|>.
    gen.update(eos_token_id=[2, 7], temperature=0.0, max_new_tokens=4, top_p=0.5)
    gen_file.write_text(json.dumps(gen))
    return LLM(str(path), max_model_len=64, max_num_seqs=4, block_size=8)


def test_generation_defaults_apply_when_no_sampling_params_are_given(llm):
    defaults = llm.get_default_sampling_params()
    assert defaults == SamplingParams(temperature=0.0, max_tokens=4, top_p=0.5)
    implicit = llm.generate(PROMPTS, use_tqdm=False)
    explicit = llm.generate(PROMPTS, defaults, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in implicit] == [o.outputs[0].token_ids for o in explicit]
    assert all(len(o.outputs[0].token_ids) <= 4 for o in implicit)
    # Explicit SamplingParams are used as given (vLLM's LLM.generate does the same).
    (out,) = llm.generate(
        PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    assert len(out.outputs[0].token_ids) == 6


@pytest.mark.parametrize(("eos", "stop_reason"), [(2, None), (7, 7)])
def test_min_tokens_holds_back_every_eos_id(llm, eos, stop_reason):
    assert llm.engine.eos_token_ids == (2, 7)
    # The bias makes `eos` the greedy choice at every position: only the min_tokens mask keeps
    # it out of the first three tokens, and then it stops the request.
    params = SamplingParams(temperature=0, min_tokens=3, max_tokens=8, logit_bias={eos: 100.0})
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        c = out.outputs[0]
        assert len(c.token_ids) == 4 and c.token_ids[-1] == eos, c.token_ids
        assert not {2, 7} & set(c.token_ids[:3]), c.token_ids
        assert (c.finish_reason, c.stop_reason) == ("stop", stop_reason)
    # ignore_eos: neither id stops it.
    ignoring = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={7: 100.0})
    (out,) = llm.generate(PROMPTS[:1], ignoring, use_tqdm=False)
    assert out.outputs[0].token_ids == [7] * 5 and out.outputs[0].finish_reason == "length"
