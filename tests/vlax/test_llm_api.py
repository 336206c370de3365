"""The LLM API on the embedded default checkpoint (it has a tokenizer and a chat template)."""

import pytest

from runtime.config import ConfigError
from runtime.runner.model_runner import KVCacheSizeError
from vlax import LLM, SamplingParams
from vlax.default_model import default_model_path


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(default_model_path(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, dtype="float32", max_model_len=256, max_num_seqs=8, block_size=16)


def test_text_prompts_in_order_with_text_and_finish_reasons(llm):
    prompts = ["Hello", "The capital of France is", "a b c d e f g"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        assert o.prompt_token_ids == llm.tokenizer.encode(o.prompt)
        c = o.outputs[0]
        assert o.finished and c.finish_reason in ("length", "stop")
        assert c.text == llm.tokenizer.decode(c.token_ids)


def test_stop_string_cuts_text_and_finishes(llm):
    free = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    sp = SamplingParams(temperature=0, max_tokens=12, stop=[stop])
    out = llm.generate(["Hello"], sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    sp = SamplingParams(temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=True)
    out = llm.generate(["Hello"], sp, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop) + len(stop)]


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=7, n=3, ignore_eos=True)
    a = llm.generate(["Once upon a time"], sp, use_tqdm=False)[0]
    # The same seeded request mixed into a different batch samples the same tokens.
    b = llm.generate(
        ["other", "Once upon a time", "more"],
        [SamplingParams(max_tokens=3), sp, SamplingParams(max_tokens=5)],
        use_tqdm=False,
    )[1]
    assert len(a.outputs) == 3 and [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_logprobs_and_prompt_logprobs_shapes(llm):
    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    o = llm.generate(["Hello there friend"], sp, use_tqdm=False)[0]
    c = o.outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    for tok, pos in zip(c.token_ids, c.logprobs, strict=True):
        assert tok in pos and 3 <= len(pos) <= 4
        assert max(pos.values(), key=lambda lp: lp.logprob).rank == 1  # greedy took the top one
    assert c.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for p, t in zip(c.logprobs, c.token_ids, strict=True))
    )
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(o.prompt_token_ids)
    for tok, pos in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True):
        assert tok in pos


def test_logprob_token_ids_return_those_ids_in_place_of_the_top_k(llm):
    """vLLM's logprob_token_ids: each position holds the sampled token and exactly the listed ids
    (their raw logprobs, ranked 1..n by their place in the list, a listed sampled token too), in a
    batch beside a top-k request and one without logprobs, none of whose tokens change."""
    prompt = "The capital of France is"
    kw = dict(temperature=0, max_tokens=5, ignore_eos=True)
    (top,) = llm.generate([prompt], SamplingParams(**kw, logprobs=20), use_tqdm=False)
    top = top.outputs[0]
    first = sorted(top.logprobs[0].items(), key=lambda item: item[1].rank)
    # Listed: the 8th, the sampled (1st) and the 16th most likely first tokens.
    listed = [first[7][0], top.token_ids[0], first[15][0]]
    mixed = llm.generate(
        [prompt, prompt, prompt],
        [
            SamplingParams(**kw, logprob_token_ids=listed),
            SamplingParams(**kw, logprobs=3),
            SamplingParams(**kw),
        ],
        use_tqdm=False,
    )
    assert all(o.outputs[0].token_ids == top.token_ids for o in mixed)
    c = mixed[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    for k, (tok, pos) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        assert set(pos) == {tok, *listed}
        for place, t in enumerate(listed, 1):
            assert pos[t].rank == place
            if t in top.logprobs[k]:
                assert pos[t].logprob == pytest.approx(top.logprobs[k][t].logprob, abs=1e-5)
        if tok not in listed:
            assert pos[tok].rank == 1  # greedy: the sampled token's own rank
    assert c.cumulative_logprob == pytest.approx(top.cumulative_logprob, abs=1e-4)
    assert len(mixed[1].outputs[0].logprobs[0]) in (3, 4) and mixed[2].outputs[0].logprobs is None
    with pytest.raises(
        ValueError, match="logprobs=2: expected None or len\\(logprob_token_ids\\)=3"
    ):
        SamplingParams(logprobs=2, logprob_token_ids=listed)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"logprob_token_ids holds token id {vocab}, outside"):
        llm.generate([prompt], SamplingParams(logprob_token_ids=[1, vocab]), use_tqdm=False)


def test_steps_reading_every_row_agree_with_steps_reading_the_sampled_rows(llm):
    """A step without prompt logprobs asks the model for the sampled rows' state alone (its last
    MLP runs on those: model/base.py forward); one with prompt logprobs reads every row. Both give
    the same tokens and, within f32 rounding of other dot shapes, the same logprobs."""
    prompts = ["The capital of France is", "a b c d e f g h i j k l m n o p"]
    kw = dict(temperature=0, max_tokens=6, logprobs=4, ignore_eos=True)
    sampled = llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)
    every = llm.generate(prompts, SamplingParams(**kw, prompt_logprobs=1), use_tqdm=False)
    for a, b in zip(sampled, every, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert set(pa) == set(pb)
            for t in pa:
                assert pa[t].logprob == pytest.approx(pb[t].logprob, abs=1e-4)


def test_detokenize_false_gives_token_ids_only(llm):
    """vLLM's detokenize=False: the same tokens, text "" and no decoded logprob tokens; stop
    strings (matched on the text) are refused with it."""
    kw = dict(temperature=0, max_tokens=5, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    (plain,) = llm.generate(["Hello there"], SamplingParams(**kw), use_tqdm=False)
    (ids,) = llm.generate(["Hello there"], SamplingParams(**kw, detokenize=False), use_tqdm=False)
    assert ids.outputs[0].token_ids == plain.outputs[0].token_ids and plain.outputs[0].text
    assert ids.outputs[0].text == ""
    for got, want in zip(ids.outputs[0].logprobs, plain.outputs[0].logprobs, strict=True):
        assert {t: p.logprob for t, p in got.items()} == {t: p.logprob for t, p in want.items()}
        assert all(p.decoded_token is None for p in got.values())
    assert all(p.decoded_token is None for row in ids.prompt_logprobs[1:] for p in row.values())
    with pytest.raises(ValueError, match="stop=\\['x'\\]: expected no stop strings"):
        SamplingParams(stop=["x"], detokenize=False)


def test_chat_uses_the_template(llm):
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.prompt == llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)


def test_bad_inputs_name_the_problem(llm, path):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [10**7]}], use_tqdm=False)
    with pytest.raises(TypeError, match="a prompt must be"):
        llm.generate([3.5], use_tqdm=False)
    with pytest.raises(ConfigError, match="exceeds the checkpoint's max_position_embeddings"):
        LLM(path, max_model_len=10**6)
    with pytest.raises(KVCacheSizeError, match="max_model_len=256 needs 16 KV blocks"):
        LLM(path, max_model_len=256, num_kv_blocks=8)
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        LLM(path, attention_backend="flash")
    # The engine is still usable after the refused requests.
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
