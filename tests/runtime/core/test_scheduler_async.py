"""Async scheduling (vLLM's AsyncScheduler): the next step is planned while one is in flight, its
sampled tokens as placeholders. Each test is a scenario where the bookkeeping could go wrong;
benchmarks/vllm_scheduler_diff.py --async checks whole workloads against vLLM itself."""

import pytest
from scheduler_driver import add, make, request

from runtime.core import scheduler as sch
from runtime.core.devtools.device_rows import DeviceRows
from runtime.core.outputs import ModelRunnerOutput
from runtime.core.request import FinishReason, PoolingParams, Request, RequestStatus
from runtime.core.scheduling.scheduler_invariants import check_output, check_state


def device_token(prompt, tokens):
    return len(tokens) * 10 + 1


class Loop:
    """schedule N+1, then update N, as vLLM's engine core does with one step in flight."""

    def __init__(self, state):
        self.state, self.device, self.pending, self.outputs = (
            state,
            DeviceRows(device_token),
            [],
            [],
        )

    def schedule(self):
        before = self.state
        self.state, out = sch.schedule(before)
        check_output(before, self.state, out)
        self.pending.append((out, self.device.execute(out)))
        return out

    def update(self):
        out, runner = self.pending.pop(0)
        self.state, outputs = sch.update(self.state, out, runner)
        check_state(self.state)
        self.outputs += outputs
        return outputs

    def tokens(self, request_id):
        return tuple(t for o in self.outputs if o.req_id == request_id for t in o.new_token_ids)


def test_decode_is_planned_with_a_placeholder_for_the_token_in_flight():
    loop = Loop(add(make(async_scheduling=True), request("a", 6, 3)))
    assert loop.schedule().num_scheduled_tokens == {"a": 6}
    second = loop.schedule()  # step 0 (the prefill, which samples) still in flight
    (data,) = second.scheduled_cached_reqs
    assert second.num_scheduled_tokens == {"a": 1}
    assert (data.num_computed_tokens, data.num_output_tokens) == (6, 1)
    loop.update()
    third = loop.schedule()
    assert third.scheduled_cached_reqs[0].num_computed_tokens == 7
    loop.update()
    # max_tokens=3: steps 1 and 2 in flight bring the third token, so no step 3 is planned.
    assert loop.schedule().num_scheduled_tokens == {}
    loop.update()
    loop.update()
    assert loop.tokens("a") == (61, 71, 81) and not sch.has_unfinished_requests(loop.state)


def test_one_step_in_flight_at_most_and_only_in_async_mode():
    state = add(make(async_scheduling=True), request("a", 6, 3))
    state, _ = sch.schedule(state)
    state, _ = sch.schedule(state)
    with pytest.raises(sch.SchedulerError, match=r"steps 0\.\.1 are in flight"):
        sch.schedule(state)
    state, _ = sch.schedule(add(make(), request("a", 6, 3)))
    with pytest.raises(sch.SchedulerError, match="has not been applied"):
        sch.schedule(state)
    with pytest.raises(sch.SchedulerConfigError, match="async_scheduling"):
        make(async_scheduling=1)


def test_a_step_in_flight_for_a_finished_request_is_passed_over_even_if_its_id_is_reused():
    loop = Loop(add(make(async_scheduling=True), request("a", 6, 5, eos=71)))
    loop.schedule()
    loop.schedule()  # step 1 plans a's decode with a placeholder
    loop.update()
    loop.schedule()  # step 2
    (output,) = loop.update()  # step 1 samples the EOS: a finishes while step 2 is in flight
    assert output.finish_reason is FinishReason.STOP and loop.tokens("a") == (61, 71)
    loop.state = add(loop.state, request("a", 3, 2))  # the same id, a new request
    assert loop.schedule().scheduled_new_reqs[0].req_id == "a"
    assert loop.update() == ()  # step 2 was the old a's: nothing of it reaches the new one
    loop.update()
    assert loop.outputs[-1].new_token_ids == (31,)


def test_a_request_preempted_with_a_step_in_flight_still_gets_that_token():
    # Two requests fill the pool; b's decode needs a new block while a's step is in flight.
    state = make(async_scheduling=True, num_blocks=5, max_model_len=16, block_size=4)
    loop = Loop(add(state, request("a", 4, 6), request("b", 4, 6)))
    loop.schedule()
    preempting = None
    for _ in range(12):
        out = loop.schedule()
        if out.preempted_req_ids:
            preempting = out
            break
        loop.update()
    assert preempting is not None
    victim = preempting.preempted_req_ids[0]
    had = len(loop.tokens(victim))
    loop.update()  # the victim's step from before the preemption is applied now
    request_now = loop.state.requests[victim]
    assert request_now.status is RequestStatus.PREEMPTED and request_now.num_computed_tokens == 0
    assert len(loop.tokens(victim)) == had + 1
    for _ in range(40):
        if not sch.has_unfinished_requests(loop.state):
            break
        loop.schedule()
        loop.update()
    while loop.pending:
        loop.update()
    # Both get the tokens they get alone: position p gives p * 10 + 1.
    assert loop.tokens("a") == loop.tokens("b") == (41, 51, 61, 71, 81, 91)


def test_a_pooling_request_in_flight_leaves_no_placeholder_and_pools_once():
    embed = PoolingParams().verify("embed", model="m")
    state = make(async_scheduling=True, max_num_batched_tokens=8, max_num_seqs=4)
    state = add(state, Request("p", tuple(range(3, 23)), pooling_params=embed))
    pending, pooled, scheduled = [], [], []
    for _ in range(10):
        if sch.has_unfinished_requests(state):
            before = state
            state, out = sch.schedule(before)
            check_output(before, state, out)
            scheduled.append(dict(out.num_scheduled_tokens))
            ends = {d.req_id: d.num_computed_tokens for d in out.scheduled_cached_reqs}
            ends |= {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
            rows = tuple(out.num_scheduled_tokens)
            done = [ends[r] + out.num_scheduled_tokens[r] == 20 for r in rows]
            runner = ModelRunnerOutput(
                rows, tuple(() for _ in rows), pooler_output=tuple("v" if d else None for d in done)
            )
            pending.append((out, runner))
        elif not pending:
            break
        if len(pending) == 2 or not sch.has_unfinished_requests(state):
            state, outputs = sch.update(state, *pending.pop(0))
            check_state(state)
            pooled += [o.pooling_output for o in outputs]
    # Chunks of 8, 8, 4; nothing is planned for it while its last chunk is in flight.
    assert scheduled == [{"p": 8}, {"p": 8}, {"p": 4}, {}]
    assert pooled == ["v"] and not sch.has_unfinished_requests(state)
