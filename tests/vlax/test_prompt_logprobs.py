"""Prompt logprobs through `LLM.generate` against HF transformers, with every way a prompt's tokens
can reach the model: computed whole (no hit), after a prefix-cache hit, in chunks, and computed
again after a preemption.

vLLM does not read the prefix cache for a request that asks for prompt logprobs (a hit would skip
the positions whose logprobs it must return); it still writes its full blocks to the cache. The
scenario that used to break: a 40-token prompt whose first 32 tokens hit the cache got 8 entries
back, describing positions 32 onward.
"""

import numpy as np
import pytest

from model.testing import hf_greedy, hf_load, hf_logits, write_tiny_checkpoint
from runtime.core.outputs import NewRequestData, SchedulerOutput
from runtime.runner.errors import RequestFailed
from vlax import LLM, SamplingParams

BLOCK = 4
PROMPT_LEN, SHARED = 40, 32
TOP = 3
WITH_PROMPT_LOGPROBS = SamplingParams(
    temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=TOP
)
PLAIN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("prompt_lp") / "llama", "llama", seed=1)


@pytest.fixture(scope="module")
def hf(path):
    return hf_load(path)


@pytest.fixture(scope="module")
def prompts():
    """Three 40-token prompts sharing their first 32 tokens, and one unrelated prompt."""
    rng = np.random.default_rng(21)
    shared = rng.integers(3, 128, SHARED).tolist()
    tails = [rng.integers(3, 128, PROMPT_LEN - SHARED).tolist() for _ in range(3)]
    return {
        "warm": shared + tails[0],
        "hit": shared + tails[1],
        "hit2": shared + tails[2],
        "fresh": rng.integers(3, 128, PROMPT_LEN).tolist(),
    }


def hf_prompt_logprobs(model, prompt):
    """Per position i >= 1: (log p(prompt[i] | prompt[:i]), its rank, the top-TOP ids and values)."""
    logits = hf_logits(model, prompt)[:-1]
    lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    out = []
    for i, token in enumerate(prompt[1:]):
        top = np.argsort(-lp[i])[:TOP]
        rank = int(np.sum(lp[i] >= lp[i, token]))
        out.append((float(lp[i, token]), rank, {int(t): float(lp[i, t]) for t in top}))
    return out


def check_prompt_logprobs(output, model, atol=2e-3):
    prompt = output.prompt_token_ids
    ours = output.prompt_logprobs
    assert ours is not None and len(ours) == len(prompt), (
        f"{len(ours or [])} prompt logprob entries for a {len(prompt)}-token prompt"
    )
    assert ours[0] is None
    for i, (theirs, position) in enumerate(
        zip(hf_prompt_logprobs(model, prompt), ours[1:], strict=True)
    ):
        logprob, rank, top = theirs
        token = prompt[i + 1]
        assert token in position, f"position {i + 1}: prompt token {token} missing"
        assert abs(position[token].logprob - logprob) < atol, (i + 1, position[token], logprob)
        assert position[token].rank == rank, (i + 1, position[token].rank, rank)
        best = max(top, key=top.get)
        assert best in position and abs(position[best].logprob - top[best]) < atol, (i + 1, best)


def new_request_data(llm, request_id):
    (data,) = [
        nd for so in llm.engine.history for nd in so.scheduled_new_reqs if nd.req_id == request_id
    ]
    return data


def generate(llm, prompt, params):
    first = len(llm.engine.history)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out, llm.engine.history[first:]


def test_prompt_logprobs_with_and_without_a_prefix_hit_match_hf(path, hf, prompts):
    llm = LLM(
        path, dtype="float32", max_model_len=64, block_size=BLOCK, max_num_seqs=2, record_steps=None
    )
    # No hit: nothing is cached yet.
    fresh, _ = generate(llm, prompts["fresh"], WITH_PROMPT_LOGPROBS)
    check_prompt_logprobs(fresh, hf)
    # The warm-up caches the 32 shared tokens (8 blocks) ...
    generate(llm, prompts["warm"], PLAIN)
    out, steps = generate(llm, prompts["hit"], WITH_PROMPT_LOGPROBS)
    # ... which a plain request would hit, but a prompt-logprobs request computes all 40 tokens.
    first = new_request_data(llm, out.request_id)
    assert first.num_computed_tokens == 0
    assert steps[0].num_scheduled_tokens[out.request_id] == PROMPT_LEN
    check_prompt_logprobs(out, hf)
    assert out.outputs[0].token_ids == hf_greedy(hf, prompts["hit"], 2)
    # It still wrote its blocks: the same prompt again, without prompt logprobs, hits all of
    # them but the block holding the last prompt token (which is always computed).
    again, _ = generate(llm, prompts["hit"], PLAIN)
    assert new_request_data(llm, again.request_id).num_computed_tokens == 36

    # The runner's own guard, should a prompt-logprobs request ever start past its first token
    # again: that request fails before the device step, named, and the runner is left as it was.
    runner = llm.engine.runner
    start = SchedulerOutput(
        step=10_000,
        scheduled_new_reqs=(
            NewRequestData(
                "skipped",
                tuple(prompts["hit"]),
                (),
                WITH_PROMPT_LOGPROBS,
                tuple(range(1, 11)),
                num_computed_tokens=32,
            ),
        ),
        scheduled_cached_reqs=(),
        num_scheduled_tokens={"skipped": 8},
        total_num_scheduled_tokens=8,
        scheduled_encoder_inputs={},
        free_encoder_hashes=(),
        preempted_req_ids=(),
        finished_req_ids=(),
    )
    with pytest.raises(RequestFailed, match="positions 0..31 were never computed") as failed:
        runner.execute(start)
    assert failed.value.request_ids == ("skipped",) and "skipped" not in runner.rows


def test_prompt_logprobs_over_chunked_prefill_with_a_prefix_hit_match_hf(path, hf, prompts):
    # A 16-token budget: the 40-token prompt is computed in chunks of 16, 16 and 8.
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=64,
        block_size=BLOCK,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        record_steps=None,
    )
    generate(llm, prompts["warm"], PLAIN)
    out, steps = generate(llm, prompts["hit2"], WITH_PROMPT_LOGPROBS)
    chunks = [so.num_scheduled_tokens[out.request_id] for so in steps[:3]]
    assert chunks == [16, 16, 8]
    check_prompt_logprobs(out, hf)


def computed_when_preempted(steps, request_id):
    """How many tokens the request had computed when it was first preempted."""
    computed = 0
    for so in steps:
        if request_id in so.preempted_req_ids:
            return computed
        computed += so.num_scheduled_tokens.get(request_id, 0)
    raise AssertionError(f"request {request_id!r} was never preempted")


def test_prompt_logprobs_of_preempted_requests_match_hf(path, hf, prompts):
    """16 usable blocks of 4 tokens, 12 tokens a step. Each time a plain request that decodes long
    runs first, and the prompt-logprobs request admitted after it runs out of blocks and is
    preempted: once in the middle of its chunked prefill, once while decoding. Each computes its
    prompt again from the start; its prompt logprobs are still one entry per prompt token."""
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=64,
        block_size=BLOCK,
        max_num_seqs=2,
        num_kv_blocks=17,
        max_num_batched_tokens=12,
        record_steps=None,
    )
    rng = np.random.default_rng(5)
    cases = [
        # (plain prompt, its max_tokens, prompt-logprobs prompt, its max_tokens, preempted in prefill)
        (28, 20, 36, 2, True),
        (24, 34, 24, 16, False),
    ]
    for plain_len, plain_max, victim_len, victim_max, in_prefill in cases:
        plain = rng.integers(3, 128, plain_len).tolist()
        victim = rng.integers(3, 128, victim_len).tolist()
        first = len(llm.engine.history)
        outs = llm.generate(
            [{"prompt_token_ids": plain}, {"prompt_token_ids": victim}],
            [
                SamplingParams(temperature=0.0, max_tokens=plain_max, ignore_eos=True),
                SamplingParams(
                    temperature=0.0, max_tokens=victim_max, ignore_eos=True, prompt_logprobs=TOP
                ),
            ],
            use_tqdm=False,
        )
        steps = llm.engine.history[first:]
        victim_id = outs[1].request_id
        assert (computed_when_preempted(steps, victim_id) < victim_len) == in_prefill
        resumed = [
            c
            for so in steps
            for c in so.scheduled_cached_reqs
            if c.req_id == victim_id and c.resumed_from_preemption
        ]
        # Its own blocks may still be cached, but it reads none of them back.
        assert resumed and resumed[0].num_computed_tokens == 0
        check_prompt_logprobs(outs[1], hf)
        assert outs[1].outputs[0].token_ids == hf_greedy(hf, victim, victim_max)


def test_prompt_logprobs_request_loads_nothing_from_the_kv_store(path, hf, prompts):
    """The prompt's blocks are in the host store and no longer in the device cache: a plain
    request would load 9 of them; a prompt-logprobs request computes all 40 tokens instead."""
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=64,
        block_size=BLOCK,
        max_num_seqs=2,
        num_kv_blocks=24,
        kv_offload="host",
        kv_offload_bytes=8 << 20,
        record_steps=None,
    )
    try:
        generate(llm, prompts["hit"], PLAIN)
        rng = np.random.default_rng(9)
        fillers = [{"prompt_token_ids": rng.integers(3, 128, PROMPT_LEN).tolist()} for _ in "abc"]
        llm.generate(fillers, PLAIN, use_tqdm=False)  # 23 usable blocks: the prompt is evicted
        stats = llm.engine.offload_stats
        assert stats.blocks_stored >= 10 and stats.blocks_loaded == 0

        out, _ = generate(llm, prompts["hit"], WITH_PROMPT_LOGPROBS)
        assert new_request_data(llm, out.request_id).num_computed_tokens == 0
        assert llm.engine.offload_stats.blocks_loaded == 0
        check_prompt_logprobs(out, hf)

        llm.generate(fillers, PLAIN, use_tqdm=False)  # evicts it again (they load from the store)
        loaded = llm.engine.offload_stats.blocks_loaded
        again, _ = generate(llm, prompts["hit"], PLAIN)
        assert llm.engine.offload_stats.blocks_loaded - loaded == 9
        assert new_request_data(llm, again.request_id).num_computed_tokens == 36
    finally:
        llm.engine.close()
