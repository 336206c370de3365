"""Input processor: EOS ids from every source, generation defaults as vLLM applies them, and one
refusal per field a request carries, each naming the value."""

import logging

import pytest

from model.config import from_hf_dict
from runtime.config import ConfigError
from runtime.core.request import SamplingParams
from runtime.input_processor import InputProcessor, default_sampling_params, resolve_eos_token_ids
from runtime.tokenizer import Tokenizer
from vlax.default_model import default_model_path

HF = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    max_position_embeddings=64,
    eos_token_id=[3, 2],
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_pretrained(default_model_path(tmp_path_factory.mktemp("cache")))


def config(gen=None, **hf):
    return from_hf_dict({**HF, **hf}, gen, path="ckpt")


def processor(tokenizer=None, gen=None, max_model_len=16, max_logprobs=-1, **hf):
    return InputProcessor(config(gen, **hf), tokenizer, max_model_len, max_logprobs=max_logprobs)


def test_eos_ids_come_from_config_generation_config_and_tokenizer(tok, caplog):
    assert tok.eos_token_id == 2
    # The tokenizer's EOS is vLLM's EOS: first. Then config.json's and generation_config.json's.
    cfg = config({"eos_token_id": [9, 3]})
    assert resolve_eos_token_ids(cfg, tok) == (2, 3, 9)
    assert resolve_eos_token_ids(cfg, None) == (3, 2, 9)
    assert resolve_eos_token_ids(config(None, eos_token_id=4), None) == (4,)
    assert resolve_eos_token_ids(config(None, eos_token_id=None), None) == ()
    with caplog.at_level(logging.WARNING, logger="runtime.input_processor"):
        assert resolve_eos_token_ids(config({"eos_token_id": 40}), None) == (3, 2)
    assert "EOS id(s) [40] are outside the vocabulary [0, 32)" in caplog.text
    # Every core request carries the whole set.
    done = processor(tok, {"eos_token_id": [9]}).process("r", [5, 6], SamplingParams(n=2))
    assert [c.eos_token_ids for c in done.children] == [(2, 3, 9)] * 2


def test_generation_defaults_apply_where_no_params_are_given():
    gen = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7, "do_sample": True}
    p = processor(gen=gen)
    assert p.default_params == SamplingParams(temperature=0.6, top_p=0.9, top_k=20, max_tokens=7)
    assert p.process("r", [5], None).params == p.default_params
    # A caller's SamplingParams is used as it is (vLLM's LLM.generate does the same).
    mine = SamplingParams(temperature=0.0)
    assert p.process("r", [5], mine).params is mine
    assert default_sampling_params(config()) == SamplingParams()
    with pytest.raises(ConfigError, match="generation_config.json sets sampling defaults"):
        default_sampling_params(config({"top_p": 0.0}))


def test_n_fans_out_into_samples_with_their_own_seeds():
    done = processor().process("r", [5, 6], SamplingParams(n=3, seed=10), prompt="hi")
    assert [c.request_id for c in done.children] == ["r.0", "r.1", "r.2"]
    assert [c.sampling_params.seed for c in done.children] == [10, 11, 12]
    assert all(c.sampling_params.n == 1 for c in done.children)
    assert done.prompt == "hi" and done.prompt_token_ids == (5, 6)
    assert processor().process("r", [5], SamplingParams()).children[0].request_id == "r"


@pytest.mark.parametrize(
    ("prompt", "params", "error", "match"),
    [
        ([5, 32], None, ValueError, "request 'r': prompt token id 32, outside the vocabulary"),
        ([5, -1], None, ValueError, r"prompt token id -1, outside the vocabulary \[0, 32\)"),
        ([], None, ValueError, "request 'r': the prompt is empty"),
        ([5] * 16, None, ValueError, "the prompt has 16 tokens, which leaves no room"),
        ([5, 2.5], None, TypeError, "prompt token id 2.5 is not an int"),
        ("hello", None, TypeError, "prompt_token_ids must be a list of ints"),
        (
            [5],
            SamplingParams(stop_token_ids=[4, 99]),
            ValueError,
            r"stop_token_ids holds token id 99, outside the vocabulary \[0, 32\)",
        ),
        (
            [5],
            SamplingParams(logit_bias={40: 1.0}),
            ValueError,
            r"logit_bias holds token id 40, outside the vocabulary \[0, 32\)",
        ),
        (
            [5],
            SamplingParams(allowed_token_ids=[4, 32]),
            ValueError,
            r"allowed_token_ids holds token id 32, outside the vocabulary \[0, 32\)",
        ),
        (
            [5],
            SamplingParams(bad_words=["x"]),
            ValueError,
            r"bad_words=\['x'\] needs a tokenizer to turn the words into token ids, and this "
            "checkpoint has none",
        ),
        (
            [5],
            SamplingParams(logprobs=33),
            ValueError,
            r"logprobs=33 asks for more top tokens than the vocabulary has \(32\)",
        ),
        (
            [5],
            SamplingParams(prompt_logprobs=40),
            ValueError,
            r"prompt_logprobs=40 asks for more top tokens than the vocabulary has \(32\)",
        ),
        (
            [5],
            SamplingParams(stop=["x"]),
            ValueError,
            "needs a tokenizer to detokenize the output, and this checkpoint has none",
        ),
        ([5], {"temperature": 0}, TypeError, "params must be a SamplingParams"),
    ],
)
def test_each_bad_field_is_refused_by_name(prompt, params, error, match):
    with pytest.raises(error, match=match):
        processor().process("r", prompt, params)


def test_limits_that_are_just_inside_are_accepted():
    p = processor()
    done = p.process(
        "r",
        [31] * 15,
        SamplingParams(
            max_tokens=16,
            stop_token_ids=[31],
            logit_bias={31: 1.0},
            logprobs=32,
            prompt_logprobs=32,
            allowed_token_ids=[0, 31],
        ),
    )
    assert done.children[0].prompt_token_ids == (31,) * 15
    assert processor().process("r", [0], SamplingParams(max_tokens=None)).children


def test_prompt_inputs(tok):
    p = processor(tok)
    assert p.prompt_inputs("Hello") == ("Hello", tok.encode("Hello"))
    assert p.prompt_inputs({"prompt_token_ids": [4, 5], "prompt": "x"}) == ("x", [4, 5])
    assert p.prompt_inputs({"prompt": "Hello"}) == ("Hello", tok.encode("Hello"))
    with pytest.raises(TypeError, match="a prompt must be a str or a dict"):
        p.prompt_inputs(3.5)
    with pytest.raises(ValueError, match="this checkpoint has no tokenizer"):
        processor().prompt_inputs("Hello")


def test_bad_words_are_tokenized_once_as_vllm_does(tok):
    p = processor(tok, vocab_size=tok.vocab_size)

    def encode(text):
        return tuple(tok.encode(text, add_special_tokens=False))

    # vLLM's update_from_tokenizer: the word without its leading space, then the word after a
    # space, kept only when that starts with another token and is as long.
    assert encode("of") != encode(" of") and len(encode(" of")) == 1
    assert len(encode("the")) == 2 and len(encode(" the")) == 1
    assert encode("cat")[0] != encode(" cat")[0] and len(encode("cat")) == len(encode(" cat"))
    params = SamplingParams(bad_words=["of", " the", "cat"], n=2)
    done = p.process("r", [5], params)
    want = (encode("of"), encode(" of"), encode("the"), encode("cat"), encode(" cat"))
    assert done.params.bad_words_token_ids == want
    assert [c.sampling_params.bad_words_token_ids for c in done.children] == [want] * 2
    # Equal params share one resolved object (the runner computes per-params values once).
    again = p.process("s", [6], SamplingParams(bad_words=["of", " the", "cat"], n=2))
    assert again.params is done.params
    assert p.process("t", [5], SamplingParams()).params.bad_words_token_ids is None


def test_bad_words_outside_the_model_vocabulary_are_refused_by_name(tok):
    # The tokenizer knows more ids than this 32-row model has.
    ids = list(tok.encode("zebra", add_special_tokens=False))
    with pytest.raises(
        ValueError,
        match=rf"request 'r': bad_words holds 'zebra', which tokenizes to \{ids}: token id "
        rf"{ids[0]}, outside the vocabulary \[0, 32\)",
    ):
        processor(tok).process("r", [5], SamplingParams(bad_words=["zebra"]))


def test_max_logprobs_caps_each_requests_logprobs_and_minus_one_asks_for_every_token():
    """vLLM's max_logprobs (20 by default; -1: the vocabulary) bounds logprobs and
    prompt_logprobs alike, and a count of -1 asks for the whole vocabulary (32 here)."""
    capped = processor(max_logprobs=20)
    assert capped.process("r", [5], SamplingParams(logprobs=20)).children[0].sampling_params
    for name in ("logprobs", "prompt_logprobs"):
        for value, count in ((21, 21), (-1, 32)):
            with pytest.raises(
                ValueError,
                match=rf"{name}={value} asks for {count} top logprobs, "
                r"more than max_logprobs=20",
            ):
                capped.process("r", [5], SamplingParams(**{name: value}))
    for name in ("logprobs", "prompt_logprobs"):
        (child,) = processor().process("r", [5], SamplingParams(**{name: -1})).children
        assert getattr(child.sampling_params, name) == 32
    with pytest.raises(ValueError, match=r"logprobs=-2: expected an int >= 0"):
        SamplingParams(logprobs=-2)
