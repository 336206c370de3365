"""allowed_token_ids and bad_words through LLM.generate, on the embedded default checkpoint (its
tokenizer turns bad words into token ids), greedy and sampled."""

import shutil

import numpy as np
import pytest

from vlax import LLM, SamplingParams
from vlax.default_model import default_model_path

PROMPTS = ["The capital of France is", "Hello, my name is"]
GREEDY = dict(temperature=0, max_tokens=10, ignore_eos=True)
# Few distinct sampler configurations (each is one more compilation of the step): plain greedy,
# greedy with allowed ids and every raw logprob, and sampling with allowed ids.
VOCAB = 885


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return default_model_path(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(str(model_path), max_model_len=64, max_num_seqs=8, block_size=16, max_logprobs=-1)


def generate(llm, params, prompts=PROMPTS):
    return [c for out in llm.generate(prompts, params, use_tqdm=False) for c in out.outputs]


def tokens(llm, params, prompts=PROMPTS):
    return [c.token_ids for c in generate(llm, params, prompts)]


def encode(llm, text):
    return tuple(llm.engine.tokenizer.encode(text, add_special_tokens=False))


def bigrams(seqs):
    return {pair for s in seqs for pair in zip(s, s[1:], strict=False)}


def test_allowed_token_ids_restrict_greedy_and_random_sampling(llm):
    assert llm.engine.model_config.vocab_size == VOCAB
    free = tokens(llm, SamplingParams(**GREEDY))
    allowed = [5, 86, 261, 520, 700]
    assert any(set(s) - set(allowed) for s in free)  # unrestricted, the model leaves the set
    # Greedy: at every step the allowed id with the highest (raw, returned) logprob.
    for c in generate(llm, SamplingParams(**GREEDY, allowed_token_ids=allowed, logprobs=VOCAB)):
        for token, position in zip(c.token_ids, c.logprobs, strict=True):
            assert token == max(allowed, key=lambda t: position[t].logprob)
    sampled = tokens(
        llm,
        SamplingParams(temperature=2.0, seed=1, n=4, max_tokens=10, allowed_token_ids=allowed),
    )
    assert all(set(s) <= set(allowed) for s in sampled)
    assert len({t for s in sampled for t in s}) >= 3  # sampled, not one forced id


def test_a_one_token_bad_word_is_never_generated(llm):
    plain, spaced = encode(llm, "of"), encode(llm, " of")
    assert len(plain) == len(spaced) == 1 and plain != spaced
    # The bias makes both forms the greedy choice everywhere; banned, the model's own greedy
    # choices come back.
    bias = {plain[0]: 50.0, spaced[0]: 50.0}
    forced = tokens(llm, SamplingParams(**GREEDY, logit_bias=bias))
    assert all(set(s) <= {plain[0], spaced[0]} for s in forced)
    banned = tokens(llm, SamplingParams(**GREEDY, logit_bias=bias, bad_words=["of"]))
    assert banned == tokens(llm, SamplingParams(**GREEDY))


def test_a_two_token_word_bans_its_second_token_exactly_after_its_first(llm):
    first, second = encode(llm, "the")
    assert len(encode(llm, " the")) == 1  # a spaced form of another length is not banned (vLLM)
    pair = [first, second]
    # Within {first, second} this model says "the the the": greedy picks the pair.
    free = tokens(llm, SamplingParams(**GREEDY, allowed_token_ids=pair, logprobs=VOCAB))
    assert (first, second) in bigrams(free)
    params = SamplingParams(**GREEDY, allowed_token_ids=pair, bad_words=["the"], logprobs=VOCAB)
    changed = 0
    for c in generate(llm, params):
        previous = None
        for token, position in zip(c.token_ids, c.logprobs, strict=True):
            allowed = [first] if previous == first else pair
            assert token == max(allowed, key=lambda t: position[t].logprob)
            changed += previous == first and position[second].logprob > position[first].logprob
            previous = token
    assert changed  # the ban decided some steps
    # Sampled: the second token still comes, but never right after the first.
    sample = dict(temperature=2.0, seed=3, n=16, max_tokens=16, ignore_eos=True)
    free = tokens(llm, SamplingParams(**sample, allowed_token_ids=pair))
    assert (first, second) in bigrams(free)
    banned = tokens(llm, SamplingParams(**sample, allowed_token_ids=pair, bad_words=["the"]))
    assert (first, second) not in bigrams(banned)
    assert second in np.concatenate(banned)


def test_bad_words_without_a_tokenizer_are_refused_and_the_llm_goes_on(model_path, tmp_path):
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(model_path, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink()
    llm = LLM(str(bare), max_model_len=64, max_num_seqs=8, block_size=16, max_logprobs=-1)
    assert llm.engine.tokenizer is None
    prompt = {"prompt_token_ids": [1, 20, 21]}
    with pytest.raises(ValueError, match=r"bad_words=\['of'\] needs a tokenizer"):
        llm.generate([prompt], SamplingParams(bad_words=["of"]), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = tokens(llm, SamplingParams(**GREEDY, allowed_token_ids=[5, 6], logprobs=VOCAB), [prompt])
    assert len(out[0]) == 10 and set(out[0]) <= {5, 6}
