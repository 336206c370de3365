"""Pooling requests through the pure core: prefill-only, finished in the step that computes their
last prompt token, blocks returned at the end of that step; whole prompts only when chunked
prefill is off (bidirectional models); prefix hits only for causal embedders, and none for token
tasks. Bug class 6 of serving-semantics.md §7: a pooled output must come from the whole prompt,
across chunks and preemption."""

import pytest
from scheduler_driver import add, make, request, schedule

from runtime.core import scheduler as sch
from runtime.core.kv import kv_cache as kvc
from runtime.core.outputs import ModelRunnerOutput
from runtime.core.request import FinishReason, PoolingParams, Request
from runtime.core.scheduling.scheduler_invariants import check_state

EMBED = PoolingParams().verify("embed", model="m")
TOKENS = PoolingParams().verify("token_embed", model="m")


def pooling(request_id: str, prompt, params: PoolingParams = EMBED) -> Request:
    if isinstance(prompt, int):
        base = sum(map(ord, request_id)) * 101
        prompt = tuple((base + i) % 997 + 3 for i in range(prompt))
    return Request(request_id, prompt, pooling_params=params)


def runner_output(state, out) -> ModelRunnerOutput:
    """A runner that pools a request once its prompt is computed (the pooled value names the
    request and the tokens it covers) and samples a token for a generate request."""
    req_ids, sampled, pooled = [], [], []
    for request_id, n in out.num_scheduled_tokens.items():
        request = state.requests[request_id]
        done = request.num_computed_tokens + n >= request.num_tokens
        req_ids.append(request_id)
        is_pooling = request.pooling_params is not None
        sampled.append((7,) if done and not is_pooling else ())
        pooled.append((request_id, request.num_tokens) if done and is_pooling else None)
    return ModelRunnerOutput(tuple(req_ids), tuple(sampled), pooler_output=tuple(pooled))


def step(state):
    scheduled, out = schedule(state)
    state, outputs = sch.update(scheduled, out, runner_output(scheduled, out))
    check_state(state)
    return state, out, outputs


def run(state, max_steps=100, outs=None):
    """Step until idle; returns (state, tokens scheduled per step, {req: its final output})."""
    steps, finished = [], {}
    for _ in range(max_steps):
        if not sch.has_unfinished_requests(state):
            return state, steps, finished
        state, out, outputs = step(state)
        steps.append(dict(out.num_scheduled_tokens))
        if outs is not None:
            outs.append(out)
        for o in outputs:
            assert o.req_id not in finished, f"{o.req_id} reported after it finished"
            if o.finished:
                finished[o.req_id] = o
    raise AssertionError("not finished")


def test_a_pooling_request_finishes_in_the_step_that_computes_its_prompt():
    state = add(make(), pooling("e", 10))
    total = kvc.num_free_blocks(state.kv)
    state, out, outputs = step(state)
    assert dict(out.num_scheduled_tokens) == {"e": 10}
    (new,) = out.scheduled_new_reqs
    assert new.pooling_params == EMBED
    (done,) = outputs
    assert done.finish_reason is FinishReason.STOP and done.new_token_ids == ()
    assert done.pooling_output == ("e", 10)
    # Its blocks came back at the end of the step; nothing of it is left to schedule.
    assert kvc.num_free_blocks(state.kv) == total
    assert not sch.has_unfinished_requests(state)
    _, out = schedule(state)
    assert out.finished_req_ids == ("e",) and out.total_num_scheduled_tokens == 0


def test_pooling_and_generate_requests_share_steps():
    state = add(make(), request("g", 6, max_tokens=3), pooling("e1", 5), pooling("e2", 9))
    state, steps, finished = run(state)
    # The pooling requests run once, whole; the generate request prefills then decodes.
    assert steps[0] == {"g": 6, "e1": 5, "e2": 9}
    assert steps[1:] == [{"g": 1}, {"g": 1}]
    assert finished["e1"].pooling_output == ("e1", 5)
    assert finished["e2"].pooling_output == ("e2", 9)
    assert finished["g"].new_token_ids == (7,) and finished["g"].pooling_output is None


def test_a_causal_embedder_chunks_a_long_prompt_and_pools_after_the_last_chunk():
    # budget 32: a 70-token prompt takes three steps; only the last one pools it.
    state = add(make(max_num_batched_tokens=32, max_model_len=80, num_blocks=41), pooling("e", 70))
    state, steps, finished = run(state)
    assert steps == [{"e": 32}, {"e": 32}, {"e": 6}]
    assert finished["e"].pooling_output == ("e", 70)


def test_without_chunked_prefill_only_whole_prompts_are_admitted():
    """A bidirectional model's prompt is never split: one that does not fit what is left of the
    step's budget waits for the next step, whole (vLLM stops admitting there)."""
    state = make(enable_chunked_prefill=False, max_num_batched_tokens=64, num_blocks=65)
    state = add(state, pooling("a", 40), pooling("b", 30), pooling("c", 20), pooling("d", 64))
    state, steps, finished = run(state)
    assert steps == [{"a": 40}, {"b": 30, "c": 20}, {"d": 64}]
    assert {rid: o.pooling_output for rid, o in finished.items()} == {
        "a": ("a", 40),
        "b": ("b", 30),
        "c": ("c", 20),
        "d": ("d", 64),
    }


def test_a_pooling_prompt_may_fill_max_model_len_and_no_more():
    state = add(make(max_model_len=64, max_num_batched_tokens=64), pooling("full", 64))
    _, steps, finished = run(state)
    assert steps == [{"full": 64}] and finished["full"].pooling_output == ("full", 64)
    with pytest.raises(sch.SchedulerError, match="65 tokens is longer than max_model_len=64"):
        sch.add_request(make(max_model_len=64), pooling("long", 65))
    with pytest.raises(sch.SchedulerError, match="leaves no room to generate"):
        sch.add_request(make(max_model_len=64), request("gen", 64))


def test_prefix_hits_for_embeddings_but_never_for_token_tasks():
    shared = tuple(range(3, 35))  # 32 tokens: 8 full blocks of 4
    state, _, _ = run(add(make(max_num_batched_tokens=64), pooling("warm", shared + (500, 501))))
    state = add(state, pooling("hit", shared + (600,)), pooling("tokens", shared + (700,), TOKENS))
    _, out = schedule(state)
    computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    assert computed == {"hit": 32, "tokens": 0}
    assert dict(out.num_scheduled_tokens) == {"hit": 1, "tokens": 33}


def test_a_preempted_chunked_pooling_request_recomputes_its_prompt_and_pools_once():
    """7 usable blocks of 4. "a" (4 + 20 tokens) and the embedding "e" (24 tokens) both fit when
    admitted, 2 tokens a step each (long_prefill_token_threshold); "e" is preempted mid-prompt
    when the pool runs dry, and once readmitted computes its whole prompt from token 0 again
    before it is pooled, once."""
    state = make(
        max_num_batched_tokens=16,
        max_model_len=28,
        num_blocks=8,
        long_prefill_token_threshold=2,
        enable_prefix_caching=False,
    )
    state = add(state, request("a", 4, max_tokens=20), pooling("e", 24))
    outs = []
    state, steps, finished = run(state, outs=outs)
    (at,) = [i for i, out in enumerate(outs) if out.preempted_req_ids == ("e",)]
    assert sum(s.get("e", 0) for s in steps[:at]) == 16
    assert sum(s.get("e", 0) for s in steps[at:]) == 24
    (resumed,) = [
        c
        for out in outs[at + 1 :]
        for c in out.scheduled_cached_reqs
        if c.req_id == "e" and c.resumed_from_preemption
    ]
    assert resumed.num_computed_tokens == 0
    assert finished["e"].pooling_output == ("e", 24)
    assert finished["a"].finish_reason is FinishReason.LENGTH


def test_the_runner_must_pool_a_finished_prompt_and_only_that():
    state = add(make(max_num_batched_tokens=8), pooling("e", 12))
    scheduled, out = schedule(state)  # 8 of 12 tokens
    early = ModelRunnerOutput(("e",), ((),), pooler_output=(("e", 8),))
    with pytest.raises(sch.SchedulerError, match="mid-prefill"):
        sch.update(scheduled, out, early)
    state, _ = sch.update(scheduled, out, ModelRunnerOutput(("e",), ((),)))
    scheduled, out = schedule(state)  # the last 4
    with pytest.raises(sch.SchedulerError, match="expects its pooled output"):
        sch.update(scheduled, out, ModelRunnerOutput(("e",), ((),)))
    with pytest.raises(sch.SchedulerError, match="no sampled token"):
        sch.update(scheduled, out, ModelRunnerOutput(("e",), ((5,),), pooler_output=(1,)))
    with pytest.raises(ValueError, match="pooler_output entries"):
        ModelRunnerOutput(("e",), ((),), pooler_output=(1, 2))


def test_a_request_carries_only_resolved_pooling_params():
    with pytest.raises(ValueError, match="resolved for its task"):
        Request("e", (1, 2), pooling_params=PoolingParams())
    assert Request("t", (1, 2), pooling_params=TOKENS).skip_reading_prefix_cache
    assert not Request("e", (1, 2), pooling_params=EMBED).skip_reading_prefix_cache
