"""Scenarios that break mutable schedulers, replayed against the pure one."""

from scheduler_driver import add, make, request, run, schedule, step

from runtime.core import scheduler as sch
from runtime.core.devtools.synthetic_runner import runner_output
from runtime.core.kv import kv_cache as kvc
from runtime.core.outputs import ModelRunnerOutput
from runtime.core.request import FinishReason, MultiModalInput, RequestStatus


def test_same_step_evict_and_reallocate_of_an_encoder_output():
    # failure-modes §3 (#52482): X and Y are freeable; c's Z evicts X, then d re-allocates X,
    # evicting Y, all in one step. Only Y may be freed; X must be encoded (for d), not deleted.
    state = make(encoder_cache_size=12, encoder_compute_budget=16)
    state = add(
        state,
        request("r1", 6, 1, mm=(MultiModalInput("X", 0, 4),)),
        request("r2", 6, 1, mm=(MultiModalInput("Y", 0, 4),)),
    )
    state, _, _ = run(state)
    assert state.encoder.freeable == ("X", "Y")
    state = add(
        state,
        request("c", 10, 1, mm=(MultiModalInput("Z", 0, 8),)),
        request("d", 6, 1, mm=(MultiModalInput("X", 0, 4),)),
    )
    scheduled, out = schedule(state)
    assert out.free_encoder_hashes == ("Y",)
    assert dict(out.scheduled_encoder_inputs) == {"c": (0,), "d": (0,)}
    assert set(scheduled.encoder.entries) == {"X", "Z"}


def test_preempt_then_readmit_with_a_prefix_hit():
    state = make(num_blocks=17, max_num_batched_tokens=64)
    state = add(state, request("a", 24, 20), request("b", 24, 20))
    state, outs, results = run(state)
    resumed = [c for o in outs for c in o.scheduled_cached_reqs if c.resumed_from_preemption]
    assert resumed
    data = resumed[0]
    # It kept its full blocks in the prefix cache, so it restarts from them, not from zero, and
    # computes exactly the rest of its tokens.
    assert data.num_computed_tokens > 0 and data.num_computed_tokens % 4 == 0
    i = next(i for i, o in enumerate(outs) if data in o.scheduled_cached_reqs)
    assert outs[i].num_scheduled_tokens[data.req_id] == min(
        len(data.all_token_ids) - data.num_computed_tokens, 64
    )
    assert {len(results[r][0]) for r in "ab"} == {20}
    assert all(results[r][1] is FinishReason.LENGTH for r in "ab")


def test_block_aligned_full_prompt_prefix_hit_recomputes_the_last_block():
    prompt = tuple(range(50, 62))  # 3 full blocks
    state, _, _ = run(add(make(), request("a", prompt, 2)))
    state = add(state, request("b", prompt, 2))
    state, out, outputs = step(state)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens["b"] == 4
    assert len(outputs[0].new_token_ids) == 1
    state, _, results = run(state)
    assert len(results["b"][0]) == 1  # plus the one above: both tokens asked for


def test_abort_while_waiting():
    state = add(make(max_num_seqs=1), request("a", 8, 5), request("b", 8, 5))
    state, _, _ = step(state)
    assert state.waiting == ("b",)
    state = sch.abort_requests(state, ["b"])
    assert state.waiting == () and not sch.has_request(state, "b")
    state, out = schedule(state)
    assert out.finished_req_ids == ("b",) and "b" not in out.num_scheduled_tokens


def test_abort_while_running_between_schedule_and_update():
    state = add(make(), request("a", 8, 5), request("b", 8, 5))
    scheduled, out = schedule(state)
    mro = runner_output(scheduled, out)  # the runner computed both
    aborted = sch.abort_requests(scheduled, ["a"])
    assert not kvc.has_request(aborted.kv, "a") and aborted.running == ("b",)
    state, outputs = sch.update(aborted, out, mro)
    assert [o.req_id for o in outputs] == ["b"]
    state, out = schedule(state)
    assert out.finished_req_ids == ("a",) and tuple(out.num_scheduled_tokens) == ("b",)


def test_abort_right_after_preemption():
    state = make(num_blocks=17, max_num_batched_tokens=64)
    state = add(state, request("a", 24, 20), request("b", 24, 20))
    for _ in range(60):
        scheduled, out = schedule(state)
        state, _ = sch.update(scheduled, out, runner_output(scheduled, out))
        if out.preempted_req_ids:
            break
    (victim,) = out.preempted_req_ids
    assert state.requests[victim].status is RequestStatus.PREEMPTED
    state = sch.abort_requests(state, [victim])
    free_before = kvc.num_free_blocks(state.kv)
    state, _, results = run(state)
    assert victim not in results
    assert free_before < 16 and kvc.num_free_blocks(state.kv) == 16


def test_request_id_reused_after_the_first_finished():
    state, _, first = run(add(make(), request("a", 6, 2)))
    state = add(state, request("a", (9, 9, 9, 9, 9), 3))
    state, out = schedule(state)
    assert out.finished_req_ids == ("a",)  # the runner drops the old one first
    assert [n.prompt_token_ids for n in out.scheduled_new_reqs] == [(9, 9, 9, 9, 9)]
    state, _ = sch.update(state, out, runner_output(state, out))
    state, _, second = run(state)
    assert len(first["a"][0]) == 2 and len(second["a"][0]) == 2  # 1 + 2 = the 3 asked for


def test_reused_id_is_not_hit_by_the_old_lifecycles_step_output():
    state = add(make(), request("a", 8, 5))
    scheduled, out = schedule(state)
    mro = ModelRunnerOutput(("a",), ((7,),))
    state = sch.abort_requests(scheduled, ["a"])
    state = sch.add_request(state, request("a", 20, 5))
    state, outputs = sch.update(state, out, mro)
    assert outputs == ()
    fresh = state.requests["a"]
    assert fresh.output_token_ids == () and fresh.num_computed_tokens == 0
    assert fresh.status is RequestStatus.WAITING
