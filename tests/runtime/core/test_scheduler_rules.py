"""The scheduling rules, driven through schedule/update with synthetic runner outputs."""

import pytest
from scheduler_driver import add, make, request, run, schedule, step, tokens_per_step

from runtime.core import scheduler as sch
from runtime.core.devtools.synthetic_runner import runner_output
from runtime.core.kv import block_pool as bp
from runtime.core.kv import kv_cache as kvc
from runtime.core.outputs import ModelRunnerOutput
from runtime.core.request import FinishReason, MultiModalInput, RequestStatus
from runtime.core.scheduling.scheduler_config import SchedulerConfig, SchedulerConfigError


def test_chunked_prefill_then_decode_by_one_rule():
    state = add(make(), request("a", 50, 3), request("b", 10, 2))
    state, outs, results = run(state)
    assert tokens_per_step(outs) == [{"a": 32}, {"a": 18, "b": 10}, {"a": 1, "b": 1}, {"a": 1}]
    assert [len(results[r][0]) for r in "ab"] == [3, 2]
    assert all(results[r][1] is FinishReason.LENGTH for r in "ab")
    # The runner sees each request's computed count before the step.
    cached = {c.req_id: c.num_computed_tokens for c in outs[1].scheduled_cached_reqs}
    assert cached == {"a": 32}
    assert outs[3].finished_req_ids == ("b",) and outs[0].scheduled_new_reqs[0].block_ids == tuple(
        range(1, 9)
    )


def test_long_prefill_threshold_caps_every_chunk():
    state = add(make(long_prefill_token_threshold=8), request("a", 20, 1), request("b", 5, 2))
    _, outs, _ = run(state)
    assert tokens_per_step(outs) == [{"a": 8, "b": 5}, {"a": 8, "b": 1}, {"a": 4}]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    state = make(enable_chunked_prefill=False, max_num_batched_tokens=64)
    state = add(state, request("a", 40, 2), request("b", 30, 1), request("c", 2, 1))
    _, outs, _ = run(state)
    # b does not fit in the 24 tokens left, and c does not jump the queue.
    assert tokens_per_step(outs)[:2] == [{"a": 40}, {"a": 1, "b": 30, "c": 2}]


def test_token_budget_and_max_num_seqs():
    state = add(make(max_num_seqs=2), *(request(r, 4, 2) for r in "abc"))
    _, outs, _ = run(state)
    assert tokens_per_step(outs) == [{"a": 4, "b": 4}, {"a": 1, "b": 1}, {"c": 4}, {"c": 1}]
    state = add(make(max_num_batched_tokens=10), *(request(r, 4, 1) for r in "abc"))
    _, outs, _ = run(state)
    assert tokens_per_step(outs) == [{"a": 4, "b": 4, "c": 2}, {"c": 2}]


def test_fcfs_and_priority_admission_order():
    low = request("low", 8, 1, arrival=0.0, priority=5)
    high = request("high", 8, 1, arrival=1.0, priority=0)
    tie = request("tie", 8, 1, arrival=0.5, priority=5)
    _, outs, _ = run(add(make(max_num_batched_tokens=8), low, high, tie))
    assert [tuple(o.num_scheduled_tokens) for o in outs] == [("low",), ("high",), ("tie",)]
    _, outs, _ = run(add(make(max_num_batched_tokens=8, policy="priority"), low, high, tie))
    assert [tuple(o.num_scheduled_tokens) for o in outs] == [("high",), ("low",), ("tie",)]


def _token(value):
    return lambda _request: value


def test_stop_conditions():
    def finish(req, token):
        _, _, results = run(add(make(), req), token_for=_token(token))
        return results[req.request_id]

    assert finish(request("a", 5, 8, eos=9), 9) == ((9,), FinishReason.STOP)
    assert finish(request("a", 5, 8, eos=9, ignore_eos=True), 9) == ((9,) * 8, FinishReason.LENGTH)
    assert finish(request("a", 5, 8, eos=9, min_tokens=3), 9) == ((9,) * 3, FinishReason.STOP)
    assert finish(request("a", 5, 8, stop_token_ids=[7]), 7) == ((7,), FinishReason.STOP)
    assert finish(request("a", 60, None), 5) == ((5,) * 4, FinishReason.LENGTH)  # max_model_len
    # The stop token id is reported; EOS has none.
    state = add(make(), request("a", 5, 8, stop_token_ids=[7]))
    _, _, outputs = step(state, _token(7))
    assert outputs[0].stop_reason == 7 and outputs[0].finished


def test_finished_requests_release_blocks_and_are_reported_next_step():
    state = add(make(), request("a", 6, 1), request("b", 6, 3))
    state, out, outputs = step(state)
    assert [o.finish_reason for o in outputs] == [FinishReason.LENGTH, None]
    assert not sch.has_request(state, "a") and not kvc.has_request(state.kv, "a")
    assert state.finished_since_last == ("a",)
    state, out = schedule(state)
    assert out.finished_req_ids == ("a",) and state.finished_since_last == ()


def test_prefix_hits_leave_at_least_one_token():
    prompt = tuple(range(100, 110))
    state, _, _ = run(add(make(), request("a", prompt, 1)))
    state, out = schedule(add(state, request("b", prompt, 1)))
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens["b"] == 2
    a_blocks = new.block_ids[:2]
    assert all(bp.block_hash_of(state.kv.pool, b) is not None for b in a_blocks)


def test_preemption_fcfs_takes_the_last_admitted_and_frees_it_tail_first():
    # 16 usable blocks of 4 tokens: a and b (24-token prompts, 6 blocks each) fill 12 blocks;
    # c (12 tokens) takes 3 and waits behind; decoding soon runs out of blocks.
    state = make(num_blocks=17, max_num_batched_tokens=64)
    state = add(state, request("a", 24, 20), request("b", 24, 20), request("c", 12, 2))
    seen_preemption = False
    for _ in range(60):
        before = state
        scheduled, out = schedule(state)
        if out.preempted_req_ids:
            seen_preemption = True
            (victim,) = out.preempted_req_ids
            assert victim == before.running[-1]
            table = kvc.blocks_of(before.kv, victim)
            # Released tail-first: what is still free of it ends the eviction order, tail
            # first (the request that needed blocks took them from the eviction head).
            order = bp.free_order(scheduled.kv.pool)
            still_free = sum(1 for block in table if block in order)
            assert still_free >= 1
            assert order[-still_free:] == tuple(reversed(table))[-still_free:]
            assert scheduled.waiting[0] == victim
            assert scheduled.requests[victim].status is RequestStatus.PREEMPTED
            assert scheduled.requests[victim].num_computed_tokens == 0
            assert not out.scheduled_new_reqs
            break
        state, _ = sch.update(scheduled, out, runner_output(scheduled, out))
    assert seen_preemption


def test_resumed_request_replaces_its_table_and_carries_all_tokens():
    state = make(num_blocks=17, max_num_batched_tokens=64)
    state = add(state, request("a", 24, 20), request("b", 24, 20))
    state, outs, results = run(state)
    preempted_at = next(i for i, o in enumerate(outs) if o.preempted_req_ids)
    victim = outs[preempted_at].preempted_req_ids[0]
    resumed = [
        (i, c)
        for i, o in enumerate(outs)
        for c in o.scheduled_cached_reqs
        if c.resumed_from_preemption
    ]
    assert resumed and resumed[0][1].req_id == victim and resumed[0][0] > preempted_at
    data = resumed[0][1]
    assert data.all_token_ids is not None and len(data.all_token_ids) > 24
    assert data.all_token_ids[:24] == request(victim, 24).prompt_token_ids
    assert len(data.new_block_ids) * 4 >= data.num_computed_tokens + 1
    assert {len(results[r][0]) for r in "ab"} == {20}


def test_priority_preemption_takes_the_least_urgent_even_if_already_scheduled():
    state = make(num_blocks=17, max_num_batched_tokens=64, policy="priority")
    # b arrives first (so it runs first) but is less urgent than a.
    state = add(state, request("b", 20, 30, priority=1, arrival=0.0))
    state, _, _ = step(state)
    state = add(state, request("a", 22, 30, priority=0, arrival=1.0))
    for _ in range(40):
        scheduled, out = schedule(state)
        if out.preempted_req_ids:
            assert state.running == ("b", "a")
            assert out.preempted_req_ids == ("b",) and "b" not in out.num_scheduled_tokens
            assert (
                dict(out.num_scheduled_tokens) == {"a": 1} and out.total_num_scheduled_tokens == 1
            )
            return
        state, _ = sch.update(scheduled, out, runner_output(scheduled, out))
    raise AssertionError("no preemption happened")


def test_update_rejects_stale_or_inconsistent_runner_outputs():
    state = add(make(), request("b", 4, 2), request("a", 40, 2))
    scheduled, out = schedule(state)
    assert dict(out.num_scheduled_tokens) == {"b": 4, "a": 28}
    with pytest.raises(sch.SchedulerError, match="has not been applied"):
        sch.schedule(scheduled)
    with pytest.raises(sch.SchedulerError, match="'a' was scheduled but is missing"):
        sch.update(scheduled, out, ModelRunnerOutput(("b",), ((5,),)))
    with pytest.raises(sch.SchedulerError, match="'a' is mid-prefill"):
        sch.update(scheduled, out, ModelRunnerOutput(("b", "a"), ((5,), (5,))))
    with pytest.raises(sch.SchedulerError, match="'b' computed all its tokens"):
        sch.update(scheduled, out, ModelRunnerOutput(("b", "a"), ((), ())))
    with pytest.raises(sch.SchedulerError, match="sampled token -5"):
        sch.update(scheduled, out, ModelRunnerOutput(("b", "a"), ((-5,), ())))
    with pytest.raises(sch.SchedulerError, match="did not schedule"):
        sch.update(scheduled, out, ModelRunnerOutput(("b", "a", "z"), ((5,), (), (5,))))
    good = ModelRunnerOutput(("b", "a"), ((5,), ()))
    with pytest.raises(sch.SchedulerError, match="awaits no step"):
        sch.update(state, out, good)
    updated, outputs = sch.update(scheduled, out, good)
    assert [(o.req_id, o.new_token_ids) for o in outputs] == [("b", (5,))]
    with pytest.raises(sch.SchedulerError, match="awaits no step"):
        sch.update(updated, out, good)  # applied twice


def test_add_request_rejects_bad_requests():
    state = add(make(), request("a", 4))
    with pytest.raises(sch.SchedulerError, match="in use by an unfinished request"):
        sch.add_request(state, request("a", 4))
    with pytest.raises(sch.SchedulerError, match="leaves no room"):
        sch.add_request(state, request("b", 64))
    with pytest.raises(sch.SchedulerError, match="expected a fresh request"):
        sch.add_request(state, state.requests["a"].__class__("c", (1,), output_token_ids=(2,)))
    with pytest.raises(sch.SchedulerError, match="no unfinished request has id 'zz'"):
        sch.abort_requests(state, ["a", "zz"])
    with pytest.raises(sch.SchedulerError, match="repeated ids"):
        sch.abort_requests(state, ["a", "a"])
    assert sch.has_request(state, "a")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs=0"),
        ({"policy": "lifo"}, "policy='lifo'"),
        ({"max_num_batched_tokens": 2}, "below max_num_seqs"),
        ({"enable_chunked_prefill": False}, "chunked prefill off"),
        ({"num_blocks": 10}, "one request could never finish"),
        ({"encoder_cache_size": -1}, "encoder_cache_size=-1"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching=1"),
    ],
)
def test_config_validation(overrides, match):
    base = {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 32,
        "max_model_len": 64,
        "block_size": 4,
        "num_blocks": 33,
    }
    with pytest.raises(SchedulerConfigError, match=match):
        SchedulerConfig(**{**base, **overrides})
    assert SchedulerConfig(**base).encoder_cache_size == 32


def test_admission_reserves_the_whole_sequence_unless_disabled():
    # 16 usable blocks: a holds 2, so b's 60 tokens (15 blocks) do not fit although its first
    # 24-token chunk would (vLLM's scheduler_reserve_full_isl).
    reqs = (request("a", 8, 30), request("b", 60, 1))
    _, out = schedule(add(make(num_blocks=17), *reqs))
    assert dict(out.num_scheduled_tokens) == {"a": 8}
    _, out = schedule(add(make(num_blocks=17, reserve_full_sequence=False), *reqs))
    assert dict(out.num_scheduled_tokens) == {"a": 8, "b": 24}


def test_long_prefill_cap_is_lifted_for_a_single_request():
    _, out = schedule(add(make(long_prefill_token_threshold=8), request("a", 20, 1)))
    assert dict(out.num_scheduled_tokens) == {"a": 20}


def test_a_waiting_request_whose_encoder_input_cannot_run_does_not_stall_the_queue():
    state = make(encoder_compute_budget=8)
    state = add(
        state,
        request("a", 10, 1, mm=(MultiModalInput("X", 0, 8),)),
        request("b", 10, 1, mm=(MultiModalInput("Y", 0, 8),)),
        request("c", 10, 1),
    )
    scheduled, out = schedule(state)
    assert dict(out.num_scheduled_tokens) == {"a": 10, "c": 10}
    assert scheduled.waiting == ("b",)
