"""The lifecycle of recurrent-state slots in the scheduler (hybrid models): admit, finish, abort
while running and waiting, preempt, re-admit, reuse by a new request. Every step is checked
against the state and output invariants (scheduler_driver), and every request's tokens against
the synthetic recurrent model run alone, so a state that was inherited or lost shows as tokens."""

from scheduler_driver import (
    add,
    hybrid_alone,
    hybrid_run,
    hybrid_step,
    make,
    request,
    run,
    schedule,
    tokens_per_step,
)

from runtime.core import scheduler as sch
from runtime.core.devtools.state_diff import state_diff
from runtime.core.devtools.synthetic_runner import make_slot_states, recurrent_runner_output
from runtime.core.outputs import EMPTY_MAPPING, ModelRunnerOutput
from runtime.core.request import RequestStatus

HYBRID = {"enable_prefix_caching": False}


def hybrid(num_state_slots, **overrides):
    return make(num_state_slots=num_state_slots, **HYBRID, **overrides)


def collect(tokens, engine_outputs):
    for o in engine_outputs:
        tokens[o.req_id] = tokens.get(o.req_id, ()) + o.new_token_ids
    return tokens


def test_admission_needs_a_free_slot_and_a_finished_request_frees_it():
    # max_num_seqs 4 but 2 slots: the slots bind exactly as max_num_seqs=2 would.
    requests = [request(r, 4, 2) for r in "abc"]
    _, outs, _ = run(add(make(max_num_seqs=2, **HYBRID), *requests))
    expected = tokens_per_step(outs)
    assert all(o.state_slots is EMPTY_MAPPING and o.reset_state_slots == () for o in outs)
    state, slots, outs, tokens = hybrid_run(add(hybrid(2), *requests))
    assert (
        tokens_per_step(outs)
        == expected
        == [
            {"a": 4, "b": 4},
            {"a": 1, "b": 1},
            {"c": 4},
            {"c": 1},
        ]
    )
    assert [(dict(o.state_slots), o.reset_state_slots) for o in outs] == [
        ({"a": 0, "b": 1}, (0, 1)),
        ({"a": 0, "b": 1}, ()),
        ({"c": 0}, (0,)),  # a finished; its slot goes to c, zeroed first
        ({"c": 0}, ()),
    ]
    assert state.state_slots.free == (0, 1) and not state.state_slots.owners
    assert tokens == {r.request_id: hybrid_alone(r, 64) for r in requests}


def test_abort_of_a_waiting_request_changes_no_slot_and_of_a_running_one_frees_it():
    state = add(hybrid(1), request("a", 6, 8), request("b", 6, 2), request("c", 5, 2))
    state, slots, out, _ = hybrid_step(state, make_slot_states(1))
    assert dict(out.state_slots) == {"a": 0} and out.reset_state_slots == (0,)
    pool = state.state_slots
    state = sch.abort_requests(state, ["b"])  # waiting: holds no slot
    assert state.state_slots == pool and dict(pool.owners) == {"a": 0}
    state = sch.abort_requests(state, ["a"])  # running: its slot is free at once
    assert state.state_slots.free == (0,)
    state, slots, out, first = hybrid_step(state, slots)
    assert out.finished_req_ids == ("b", "a")
    assert dict(out.state_slots) == {"c": 0} and out.reset_state_slots == (0,)
    _, _, _, tokens = hybrid_run(state, slots)
    assert collect({}, first)["c"] + tokens["c"] == hybrid_alone(request("c", 5, 2), 64)


def test_abort_between_schedule_and_update_frees_the_slot_for_the_next_step():
    state = add(hybrid(1), request("a", 6, 8), request("b", 6, 2))
    state, slots, _, _ = hybrid_step(state, make_slot_states(1))
    scheduled, out = schedule(state)
    assert dict(out.state_slots) == {"a": 0}
    scheduled = sch.abort_requests(scheduled, ["a"])
    assert scheduled.state_slots.free == (0,)
    # The runner drops the ended request; update skips it.
    state, _ = sch.update(scheduled, out, ModelRunnerOutput(req_ids=(), sampled_token_ids=()))
    state, slots, out, first = hybrid_step(state, slots)
    assert dict(out.state_slots) == {"b": 0} and out.reset_state_slots == (0,)
    _, _, _, tokens = hybrid_run(state, slots)
    assert collect({}, first)["b"] + tokens["b"] == hybrid_alone(request("b", 6, 2), 64)


TIGHT = {"max_num_seqs": 3, "max_num_batched_tokens": 64, "max_model_len": 48, "num_blocks": 13}
THREE = (request("x", 16, 20), request("y", 16, 4), request("a", 16, 4))


def three_then_preempt():
    """x, y, a prefill together and fill the 12 usable blocks; at their first decode x needs a
    block, so a (the last admitted) is preempted. Returns the state after that step, the slot
    states and the tokens so far."""
    state = add(hybrid(3, **TIGHT), *THREE)
    slots = make_slot_states(3)
    state, slots, out, outputs = hybrid_step(state, slots)
    assert dict(out.state_slots) == {"x": 0, "y": 1, "a": 2} and out.reset_state_slots == (0, 1, 2)
    tokens = collect({}, outputs)
    state, slots, out, outputs = hybrid_step(state, slots)
    assert out.preempted_req_ids == ("a",)
    assert dict(out.state_slots) == {"x": 0, "y": 1} and out.reset_state_slots == ()
    return state, slots, collect(tokens, outputs)


def test_a_preempted_request_gives_its_slot_back_and_starts_from_zero_when_readmitted():
    state, slots, before = three_then_preempt()
    assert state.state_slots.free == (2,) and "a" not in state.state_slots.owners
    assert state.requests["a"].status is RequestStatus.PREEMPTED
    state, slots, outs, after = hybrid_run(state, slots)
    (index, resumed) = next(
        (i, c)
        for i, o in enumerate(outs)
        for c in o.scheduled_cached_reqs
        if c.resumed_from_preemption
    )
    assert resumed.req_id == "a" and resumed.num_computed_tokens == 0
    assert outs[index].state_slots["a"] in outs[index].reset_state_slots
    assert outs[index].num_scheduled_tokens["a"] == 17  # its prompt and its one token, again
    for r in THREE:
        # a's first token, sampled before the preemption, is kept (recompute re-derives it)
        assert before[r.request_id] + after[r.request_id] == hybrid_alone(r, 48), r.request_id
    assert state.state_slots.free == (0, 1, 2)


def test_regression_preempted_then_its_slot_reused_by_another_request_in_the_readmission_step():
    # The scenario a mutable hybrid engine gets wrong: a is preempted (slot 2 back to the pool,
    # still holding a's state on the device), x is aborted (slot 0 free, holding x's state), d
    # arrives. In one step a is re-admitted on slot 0 and d takes a's old slot 2. Both must start
    # from zero: a rebuilds its state by recomputing from token 0, d inherits nothing of a's.
    state, slots, before = three_then_preempt()
    state = add(sch.abort_requests(state, ["x"]), request("d", 6, 2))
    state, slots, out, outputs = hybrid_step(state, slots)
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["y", "a"]
    resumed = out.scheduled_cached_reqs[1]
    assert resumed.resumed_from_preemption and resumed.num_computed_tokens == 0
    assert [n.req_id for n in out.scheduled_new_reqs] == ["d"]
    assert dict(out.state_slots) == {"y": 1, "a": 0, "d": 2}
    assert out.reset_state_slots == (0, 2)
    state, _, _, after = hybrid_run(state, slots)
    tokens = collect(before, outputs)
    tokens = {rid: tokens.get(rid, ()) + after.get(rid, ()) for rid in {*tokens, *after}}
    for r in (*THREE[1:], request("d", 6, 2)):
        assert tokens[r.request_id] == hybrid_alone(r, 48), r.request_id
    # The scenario needs the resets: a runner that skips them gives a and d other tokens
    # (a would continue from x's state, d from a's), and y, never moved, the same ones.
    state, slots, before = three_then_preempt()
    state = add(sch.abort_requests(state, ["x"]), request("d", 6, 2))
    _, _, _, after = hybrid_run(state, slots, honour_resets=False)
    assert after["y"] == tokens["y"][len(before["y"]) :]
    assert before["a"] + after["a"] != tokens["a"] and after["d"] != tokens["d"]


def test_state_diff_names_the_slots_that_changed_owner():
    state = add(hybrid(1), request("a", 4, 1), request("b", 4, 1))
    scheduled, out = schedule(state)
    assert state_diff(state, scheduled)["state_slots"] == {"a": (None, 0)}
    runner = recurrent_runner_output(make_slot_states(1), scheduled, out)[1]
    finished, _ = sch.update(scheduled, out, runner)  # a's one token: it finishes
    assert state_diff(scheduled, finished)["state_slots"] == {"a": (0, None)}
    assert state_diff(finished, schedule(finished)[0])["state_slots"] == {"b": (None, 0)}
    assert "state_slots" not in state_diff(finished, finished)
