"""A generative Qwen3 checkpoint served as an embedder (runner="pooling": causal attention, LAST
pooling, normalized), against HF transformers' last hidden state, through the whole engine: many
batch shapes, chunked prompts, prefix-cache hits, a preempted token task, matryoshka dimensions,
truncation, cosine scores, and the errors for the wrong runner."""

import numpy as np
import pytest

from model.testing import hf_load, write_tiny_checkpoint
from runtime.core.request import PoolingParams
from vlax import LLM

VOCAB = 128


def _prompts(seed: int, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, n).tolist() for n in lengths]


def _tokens(ids):
    return {"prompt_token_ids": ids}


def _normalized(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The checkpoint (declared matryoshka, as Qwen3-Embedding is served) and HF's final hidden
    states for any prompt (post-norm, as vLLM's pooler reads them)."""
    import torch

    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3"), "qwen3", seed=5, is_matryoshka=True
    )
    model = hf_load(path)
    cache = {}

    def hidden(ids):
        key = tuple(ids)
        if key not in cache:
            with torch.no_grad():
                out = model.model(torch.tensor([list(ids)]))
            cache[key] = out.last_hidden_state[0].float().numpy()
        return cache[key]

    return path, hidden


@pytest.fixture(scope="module")
def roomy(qwen3):
    """Default budget: whole prompts of every length in one step."""
    return LLM(qwen3[0], dtype="float32", runner="pooling", max_num_seqs=16, record_steps=None)


@pytest.fixture(scope="module")
def tight(qwen3):
    """17 usable blocks of 16 tokens, 48 tokens a step, at most 16 per prompt per step: prompts
    are chunked, and three 100-token prompts (7 blocks each) admitted together outgrow the pool
    (preemption)."""
    return LLM(
        qwen3[0],
        dtype="float32",
        runner="pooling",
        max_num_seqs=4,
        num_kv_blocks=18,
        max_num_batched_tokens=48,
        long_prefill_token_threshold=16,
        record_steps=None,
    )


def test_embeddings_match_hf_last_token_over_many_batch_shapes(qwen3, roomy, tight):
    _, hidden = qwen3
    batches = [
        _prompts(0, [1]),
        _prompts(1, [5, 17, 64, 3, 130, 256, 31, 2, 90]),
        _prompts(2, [200, 1, 48, 48, 7]),
    ]
    for llm in (roomy, tight):
        for prompts in batches:
            outs = llm.embed([_tokens(p) for p in prompts], use_tqdm=False)
            assert [o.prompt_token_ids for o in outs] == prompts  # input order
            for prompt, out in zip(prompts, outs, strict=True):
                got = np.asarray(out.outputs.embedding)
                want = _normalized(hidden(prompt)[-1])
                assert out.outputs.hidden_size == 64
                np.testing.assert_allclose(got, want, atol=2e-5)
                assert abs(np.linalg.norm(got) - 1) < 1e-5
    # The tight engine computed the long prompts in chunks, over several steps.
    steps_of = {}
    for out in tight.engine.history:
        for rid in out.num_scheduled_tokens:
            steps_of[rid] = steps_of.get(rid, 0) + 1
    assert max(steps_of.values()) >= 6


def test_a_repeated_prompt_hits_the_prefix_cache_and_pools_the_same(qwen3, roomy):
    _, hidden = qwen3
    (prompt,) = _prompts(3, [70])
    first = roomy.embed(_tokens(prompt), use_tqdm=False)[0].outputs.embedding
    again = roomy.embed(_tokens(prompt), use_tqdm=False)[0].outputs.embedding
    last = roomy.engine.history[-1]
    (new,) = last.scheduled_new_reqs
    assert new.num_computed_tokens == 64  # 4 cached blocks; the last token is computed
    np.testing.assert_allclose(again, first, atol=1e-6)
    np.testing.assert_allclose(again, _normalized(hidden(prompt)[-1]), atol=2e-5)


def test_encode_returns_every_token_even_across_chunks_and_preemption(qwen3, tight):
    _, hidden = qwen3
    prompts = _prompts(4, [100, 100, 100])
    before = len(tight.engine.history)
    outs = tight.encode([_tokens(p) for p in prompts], use_tqdm=False)
    steps = tight.engine.history[before:]
    assert any(out.preempted_req_ids for out in steps), "the scenario must preempt"
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs.data.shape == (100, 64)
        np.testing.assert_allclose(out.outputs.data, _normalized(hidden(prompt)), atol=2e-5)
    raw = tight.encode(_tokens(prompts[0]), PoolingParams(normalize=False), use_tqdm=False)
    np.testing.assert_allclose(raw[0].outputs.data, hidden(prompts[0]), rtol=1e-4, atol=1e-4)


def test_dimensions_truncation_and_scores(qwen3, roomy):
    _, hidden = qwen3
    (prompt,) = _prompts(5, [40])
    small = roomy.embed(_tokens(prompt), pooling_params=PoolingParams(dimensions=16))
    want = _normalized(hidden(prompt)[-1][:16])
    np.testing.assert_allclose(small[0].outputs.embedding, want, atol=2e-5)
    with pytest.raises(ValueError, match="64-dimensional embeddings"):
        roomy.embed(_tokens(prompt), pooling_params=PoolingParams(dimensions=65))
    # vLLM 0.33's normalize switch for embeddings: use_activation=False leaves the raw state.
    raw = roomy.embed(_tokens(prompt), pooling_params=PoolingParams(use_activation=False))
    np.testing.assert_allclose(raw[0].outputs.embedding, hidden(prompt)[-1], rtol=2e-5, atol=2e-5)

    (long,) = _prompts(6, [300])
    with pytest.raises(ValueError, match="300 tokens, more than max_model_len=256"):
        roomy.embed(_tokens(long), use_tqdm=False)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens value \(257\) is greater"):
        roomy.embed(_tokens(long), truncate_prompt_tokens=257)
    for keep in (-1, 100):
        cut = roomy.embed(_tokens(long), truncate_prompt_tokens=keep, use_tqdm=False)[0]
        kept = long[-(256 if keep == -1 else keep) :]  # token ids keep their last k (vLLM)
        assert cut.prompt_token_ids == kept
        np.testing.assert_allclose(cut.outputs.embedding, _normalized(hidden(kept)[-1]), atol=2e-5)

    a, b, c = _prompts(7, [12, 30, 5])
    scores = roomy.score(_tokens(a), [_tokens(b), _tokens(c)], use_tqdm=False)
    for other, out in zip((b, c), scores, strict=True):
        u, v = hidden(a)[-1], hidden(other)[-1]
        want = u @ v / np.linalg.norm(u) / np.linalg.norm(v)
        assert abs(out.outputs.score - want) < 1e-5
        assert out.prompt_token_ids == a + other


def test_the_wrong_runner_is_a_clear_error(qwen3, roomy):
    path, _ = qwen3
    with pytest.raises(ValueError) as err:
        roomy.generate("hello")
    message = str(err.value)
    assert "LLM.generate() needs a generative model" in message
    assert "got runner 'pooling'" in message and "runner='generate'" in message
    with pytest.raises(ValueError, match=r"LLM.classify\(\) needs a classification head"):
        roomy.classify(_tokens([5, 6, 7]))

    generator = LLM(path, dtype="float32")  # runner "auto": a causal LM head generates
    for call in (generator.embed, generator.encode, generator.classify):
        with pytest.raises(ValueError) as err:
            call(_tokens([5, 6, 7]))
        message = str(err.value)
        assert "needs a pooling model" in message and "got runner 'generate'" in message
        assert "runner='pooling'" in message
