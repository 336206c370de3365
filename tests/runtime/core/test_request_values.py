"""SamplingParams / Request validation, normalisation and the cheap `evolve`."""

import dataclasses

import pytest
from immutables import Map

from runtime.core.request import (
    MultiModalInput,
    Request,
    RequestStatus,
    SamplingParams,
    evolve,
)


def test_sampling_params_defaults_match_vllm():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (sp.seed, sp.max_tokens, sp.min_tokens, sp.stop, sp.stop_token_ids) == (
        None,
        16,
        0,
        (),
        (),
    )
    assert not sp.ignore_eos and not sp.include_stop_str_in_output and sp.skip_special_tokens
    assert sp.logprobs is None and sp.prompt_logprobs is None and sp.logit_bias is None
    assert not sp.greedy and SamplingParams(temperature=0.0).greedy


def test_sampling_params_follow_vllm_033s_temperature_seed_and_logprobs_rules():
    """vLLM 0.33's SamplingParams.__post_init__: a temperature in (0, 0.01) is raised to 0.01
    (only 0 itself is greedy), past 2 refused, greedy n > 1 refused; seed -1 is no seed and
    logprobs=True one logprob, False none but the token's own."""
    tiny = SamplingParams(temperature=1e-6)
    assert tiny.temperature == 0.01 and not tiny.greedy
    assert SamplingParams(temperature=2.0).temperature == 2.0
    with pytest.raises(ValueError, match=r"temperature=2.5: expected a float in \[0, 2\]"):
        SamplingParams(temperature=2.5)
    with pytest.raises(ValueError, match=r"n=2: expected 1 with greedy sampling"):
        SamplingParams(n=2, temperature=0)
    assert SamplingParams(n=2, temperature=0.5).n == 2
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    assert SamplingParams(logprobs=True).logprobs == 1
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(logprobs=False).logprobs == 0


def test_sampling_params_normalises_sequences():
    sp = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 4], logit_bias={7: 1, 2: -0.5})
    assert sp.stop == ("a", "bc") and sp.stop_token_ids == (3, 4)
    assert sp.logit_bias == ((2, -0.5), (7, 1.0))
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(logit_bias=Map({1: 2.0})).logit_bias == ((1, 2.0),)
    assert SamplingParams(logit_bias=[(1, 2.0)]).logit_bias == ((1, 2.0),)
    hash(sp)  # usable as a value
    sp = SamplingParams(allowed_token_ids=[5, 3], bad_words=["a b", "c"])
    assert sp.allowed_token_ids == (5, 3) and sp.bad_words == ("a b", "c")
    assert sp.bad_words_token_ids is None  # the input processor tokenizes the words
    sp = dataclasses.replace(sp, bad_words_token_ids=[[1, 2], [3]])
    assert sp.bad_words_token_ids == ((1, 2), (3,))
    assert SamplingParams(bad_words=[]).bad_words == ()
    hash(sp)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: float("inf")}}, "logit_bias"),
        ({"logit_bias": [(1, 1.0), (1, 2.0)]}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, 1.0]}, "allowed_token_ids"),
        ({"allowed_token_ids": 3}, "allowed_token_ids"),
        ({"bad_words": "word"}, "bad_words"),
        ({"bad_words": ["ok", " \n"]}, "bad_words"),
        ({"bad_words": ["ok", 3]}, "bad_words"),
        ({"bad_words_token_ids": [[1]]}, "bad_words_token_ids"),
        ({"bad_words": ["a"], "bad_words_token_ids": [[]]}, "bad_words_token_ids"),
        ({"bad_words": ["a"], "bad_words_token_ids": [[-1]]}, "bad_words_token_ids"),
    ],
)
def test_sampling_params_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.*expected"):
        SamplingParams(**kwargs)


def test_request_normalises_and_reports_counts():
    r = Request("r", [1, 2, 3], output_token_ids=[4])
    assert r.prompt_token_ids == (1, 2, 3) and r.output_token_ids == (4,)
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (4, 3, 1)
    assert r.all_token_ids == (1, 2, 3, 4)
    assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"request_id": ""}, "request_id"),
        ({"prompt_token_ids": ()}, "at least one token"),
        ({"prompt_token_ids": (1, -2)}, "prompt_token_ids"),
        ({"sampling_params": {}}, "sampling_params"),
        ({"eos_token_ids": (2, -1)}, "eos_token_ids"),
        ({"priority": 1.5}, "priority"),
        ({"arrival_time": float("inf")}, "arrival_time"),
        ({"num_computed_tokens": 5}, "num_computed_tokens"),
        ({"mm_inputs": (MultiModalInput("h", 2, 5),)}, "inside the 4-token prompt"),
        (
            {"mm_inputs": (MultiModalInput("a", 2, 1), MultiModalInput("b", 0, 1))},
            "sorted by offset",
        ),
        ({"mm_inputs": ("h",)}, "MultiModalInput items"),
        ({"lora_name": 3}, "lora_name"),
    ],
)
def test_request_rejects_bad_values(kwargs, match):
    base = {"request_id": "r", "prompt_token_ids": (1, 2, 3, 4)}
    with pytest.raises(ValueError, match=match):
        Request(**{**base, **kwargs})


def test_multimodal_input_validation():
    assert MultiModalInput("h", 3, 4).end == 7
    for bad in (("", 0, 1), ("h", -1, 1), ("h", 0, 0)):
        with pytest.raises(ValueError, match="MultiModalInput"):
            MultiModalInput(*bad)


def test_evolve_equals_replace_and_rejects_unknown_fields():
    r = Request("r", (1, 2, 3), priority=2)
    changed = evolve(r, num_computed_tokens=2, status=RequestStatus.RUNNING)
    assert changed == dataclasses.replace(r, num_computed_tokens=2, status=RequestStatus.RUNNING)
    assert r.num_computed_tokens == 0  # the original is untouched
    with pytest.raises(TypeError, match="num_computed"):
        evolve(r, num_computed=3)
