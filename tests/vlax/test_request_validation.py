"""Requests are refused by name at `generate` time, a batch all or nothing, and the LLM goes on.

The first three cases are the mistakes that used to wedge an LLM for good: they passed admission,
failed inside the runner's step, and every later call raised "the output of step N has not been
applied".
"""

import pytest

from vlax import LLM, SamplingParams
from vlax.default_model import default_model_path

GOOD = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = default_model_path(tmp_path_factory.mktemp("cache"))
    return LLM(str(path), max_model_len=64, max_num_seqs=4, block_size=16, max_logprobs=-1)


def serves(llm):
    out = llm.generate(["Hello"], GOOD, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [3]
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        (
            "Hello",
            SamplingParams(logit_bias={10**6: 1.0}),
            r"request '\d+': logit_bias holds token id 1000000, outside the vocabulary \[0, 885\)",
        ),
        (
            "Hello",
            SamplingParams(stop_token_ids=[5000], min_tokens=2),
            r"stop_token_ids holds token id 5000, outside the vocabulary \[0, 885\)",
        ),
        (
            "Hello",
            SamplingParams(allowed_token_ids=[5, 885]),
            r"allowed_token_ids holds token id 885, outside the vocabulary \[0, 885\)",
        ),
        (
            "Hello",
            SamplingParams(logprobs=1000),
            r"logprobs=1000 asks for more top tokens than the vocabulary has \(885\)",
        ),
        (
            "Hello",
            SamplingParams(prompt_logprobs=886),
            r"prompt_logprobs=886 asks for more top tokens than the vocabulary has \(885\)",
        ),
        (
            {"prompt_token_ids": [1, 885]},
            GOOD,
            r"prompt token id 885, outside the vocabulary \[0, 885\)",
        ),
        ({"prompt_token_ids": []}, GOOD, r"request '\d+': the prompt is empty"),
        (
            {"prompt_token_ids": [5] * 64},
            GOOD,
            "the prompt has 64 tokens, which leaves no room to generate within max_model_len=64",
        ),
    ],
    ids=[
        "logit_bias",
        "stop_token_ids",
        "allowed_token_ids",
        "logprobs",
        "prompt_logprobs",
        "prompt_token_ids",
        "empty_prompt",
        "prompt_length",
    ],
)
def test_a_bad_field_is_refused_by_name_and_the_llm_goes_on(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    serves(llm)


def test_a_batch_is_admitted_whole_or_not_at_all(llm):
    prompts = ["Hello", "The capital of France is", {"prompt_token_ids": [1, 10**6]}]
    with pytest.raises(ValueError, match="prompt token id 1000000, outside the vocabulary"):
        llm.generate(prompts, GOOD, use_tqdm=False)
    # The good prompts before the bad one were not admitted: nothing runs into the next call.
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.output_processor.requests
    out = llm.generate(["a b c"], GOOD, use_tqdm=False)
    assert [o.prompt for o in out] == ["a b c"]


def test_limits_at_the_edge_are_served(llm):
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(
        temperature=0,
        max_tokens=2,
        logprobs=vocab,
        logit_bias={vocab - 1: -1.0},
        stop_token_ids=[vocab - 1],
        min_tokens=1,
    )
    (out,) = llm.generate([{"prompt_token_ids": [1] * 61 + [vocab - 1]}], params, use_tqdm=False)
    c = out.outputs[0]
    assert len(c.token_ids) == 2 and all(len(p) >= vocab for p in c.logprobs)


def test_max_tokens_past_max_model_len_ends_at_max_model_len(llm):
    """As vLLM 0.33's offline path: not refused; the request stops when prompt and output fill
    max_model_len (64), finish reason "length"."""
    params = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": [1] * 60}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    serves(llm)
