"""A request asking for prompt logprobs reads nothing back (no prefix-cache hit, no KV-store load),
as vLLM's skip_reading_prefix_cache, yet writes its full blocks to the cache like any other.

The scenario that used to break: a 40-token prompt whose first 32 tokens were cached was admitted
with 32 computed tokens, so only positions 32 onward reached the model and got logprobs.
"""

from dataclasses import replace

import pytest
from scheduler_driver import add, make, request, run, schedule

from runtime.core.kv import block_pool as bp
from runtime.core.kv import kv_cache as kvc
from runtime.core.kv_jobs import jobs as kj
from runtime.core.kv_jobs.scheduler_hooks import enable_kv_jobs
from runtime.core.request import Request, SamplingParams

BLOCK = 4
SHARED = tuple(range(3, 35))  # 32 tokens: 8 full blocks
WARM = SHARED + tuple(range(200, 208))
PROMPT = SHARED + tuple(range(300, 308))  # 40 tokens


def test_request_carries_the_decision_from_its_sampling_params():
    assert Request("a", (1, 2), SamplingParams(prompt_logprobs=0)).skip_reading_prefix_cache
    assert not Request("b", (1, 2), SamplingParams(logprobs=3)).skip_reading_prefix_cache
    forced = SamplingParams(skip_reading_prefix_cache=True)
    assert Request("c", (1, 2), forced).skip_reading_prefix_cache
    with pytest.raises(ValueError, match="skip_reading_prefix_cache=False"):
        SamplingParams(prompt_logprobs=1, skip_reading_prefix_cache=False)
    with pytest.raises(ValueError, match="a bool or None"):
        SamplingParams(skip_reading_prefix_cache=1)


def test_a_40_token_prompt_with_32_cached_tokens_computes_all_40_and_caches_its_blocks():
    state = add(make(block_size=BLOCK, max_num_batched_tokens=64), request("warm", WARM, 1))
    state, _, _ = run(state)
    wanted = request("lp", PROMPT, 1, prompt_logprobs=2)
    state = add(state, wanted)
    plain_twin = state.requests["lp"]
    # A plain request with this prompt would hit the 8 shared blocks.
    assert kvc.find_cached_prefix(state.kv, plain_twin).num_tokens == 32

    scheduled, out = schedule(state)
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "lp" and new.num_computed_tokens == 0
    assert out.num_scheduled_tokens["lp"] == 40
    # Admission wrote its 10 full blocks to the cache under the prompt's hashes.
    table = kvc.blocks_of(scheduled.kv, "lp")
    hashes = scheduled.requests["lp"].block_hashes
    assert len(hashes) == 10
    assert [bp.block_hash_of(scheduled.kv.pool, b) for b in table[:10]] == list(hashes)

    state, _, _ = run(state)
    # Later requests hit them: 9 blocks, the block holding the last prompt token is recomputed.
    state = add(state, request("again", PROMPT, 1))
    _, out = schedule(state)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 36


def test_a_preempted_prompt_logprobs_request_is_recomputed_from_its_first_token():
    # 16 usable blocks; "a" decodes long and "lp", admitted after it, is preempted.
    state = make(block_size=BLOCK, num_blocks=17, max_num_batched_tokens=64)
    state = add(state, request("a", 24, 34), request("lp", 24, 16, prompt_logprobs=1))
    state, outs, _ = run(state)
    assert any("lp" in o.preempted_req_ids for o in outs)
    resumed = [
        c
        for o in outs
        for c in o.scheduled_cached_reqs
        if c.req_id == "lp" and c.resumed_from_preemption
    ]
    assert [c.num_computed_tokens for c in resumed] == [0] * len(resumed) and resumed


def test_a_prompt_logprobs_request_does_not_load_from_the_kv_store():
    state = enable_kv_jobs(make(block_size=BLOCK, max_num_batched_tokens=64))
    twin = add(make(block_size=BLOCK, max_num_batched_tokens=64), request("x", PROMPT, 1)).requests[
        "x"
    ]
    # The store holds the whole prompt's blocks (as another engine would have stored them).
    state = replace(state, kv_jobs=kj.note_stored(state.kv_jobs, twin.block_hashes))
    state = add(state, request("lp", PROMPT, 1, prompt_logprobs=1))
    _, out = schedule(state)
    assert not any(isinstance(job, kj.LoadJob) for job in out.kv_jobs)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert out.num_scheduled_tokens["lp"] == 40
    # A plain request with the same prompt does load the 9 blocks it may use.
    state = add(
        enable_kv_jobs(make(block_size=BLOCK, max_num_batched_tokens=64)),
        request("plain", PROMPT, 1),
    )
    state = replace(state, kv_jobs=kj.note_stored(state.kv_jobs, twin.block_hashes))
    _, out = schedule(state)
    (load,) = out.kv_jobs
    assert isinstance(load, kj.LoadJob) and len(load.block_ids) == 9
