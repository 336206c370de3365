"""Decisions where vlax's scheduler used to differ from vLLM 0.33's, and vLLM rules that no other
test reached. benchmarks/vllm_scheduler_diff.py checks the same against vLLM itself."""

import pytest
from scheduler_driver import add, make, request, schedule, step

from runtime.core.kv import block_pool as bp
from runtime.core.kv import kv_cache as kvc
from runtime.core.request import RequestStatus

# 5 usable blocks of 4 tokens.
TINY = {"num_blocks": 6, "max_model_len": 16, "max_num_batched_tokens": 32}


def three_running(policy: str, *late):
    """a (urgent) and b (least urgent) run, then c (urgent) is admitted after them: running is
    (a, b, c) and every block is held. On the step returned, b's next token needs a new block."""
    state = add(
        make(**TINY, policy=policy),
        request("a", 5, 8, priority=0, arrival=0.0),
        request("b", 3, 8, priority=2, arrival=1.0),
    )
    state, _, _ = step(state)
    state = add(state, request("c", 6, 8, priority=0, arrival=2.0))
    state, out, _ = step(state)
    assert dict(out.num_scheduled_tokens) == {"a": 1, "b": 1, "c": 6}
    assert state.running == ("a", "b", "c") and kvc.num_free_blocks(state.kv) == 0
    return add(state, *late)


def test_priority_self_preemption_goes_on_with_the_running_requests_after_it():
    """b needs a block, none is free, and b itself is the least urgent running request, so it
    preempts itself. vLLM's running loop then goes on with c, which still fits; vlax used to stop
    the loop there and leave c without a token that step."""
    before = three_running("priority")
    state, out = schedule(before)
    assert out.preempted_req_ids == ("b",)
    assert dict(out.num_scheduled_tokens) == {"a": 1, "c": 1}
    assert state.running == ("a", "c") and state.waiting == ("b",)
    assert state.requests["b"].status is RequestStatus.PREEMPTED


def test_fcfs_preempts_the_last_admitted_instead():
    state, out = schedule(three_running("fcfs"))
    assert out.preempted_req_ids == ("c",)
    assert dict(out.num_scheduled_tokens) == {"a": 1, "b": 1}
    assert state.running == ("a", "b") and state.waiting == ("c",)


def test_a_step_that_preempted_admits_nothing_under_priority():
    """After b preempts itself, its freed block would hold d, the most urgent waiting request;
    vLLM admits no waiting request in a step that preempted, and neither may vlax."""
    state, out = schedule(three_running("priority", request("d", 2, 1, arrival=3.0)))
    assert out.preempted_req_ids == ("b",) and kvc.num_free_blocks(state.kv) == 1
    assert not out.scheduled_new_reqs and "d" not in out.num_scheduled_tokens
    assert state.waiting == ("d", "b")
    # The next step admits d (most urgent first) while b keeps waiting for room.
    state, out = schedule(step(three_running("priority", request("d", 2, 1, arrival=3.0)))[0])
    assert [n.req_id for n in out.scheduled_new_reqs] == ["d"]


def test_an_unhashed_freed_block_is_reused_before_cached_prefix_blocks():
    """x (2 full blocks) and w (1 full + 1 partial block) finish together. vLLM puts w's partial
    block, which holds no hash, at the front of the free queue and the hashed ones at the back, so
    y takes it (and the two never-used blocks) and x's prefix survives for z. vlax used to queue
    every freed block at the back, so y evicted x's second block and z hit only 4 tokens."""
    x_prompt = tuple(range(100, 108))
    state = make(num_blocks=7, max_model_len=16, max_num_batched_tokens=32)
    state = add(state, request("x", x_prompt, 1), request("w", tuple(range(200, 205)), 1))
    state, out, _ = step(state)
    assert out.scheduled_new_reqs[1].block_ids == (3, 4)
    assert bp.free_order(state.kv.pool) == (4, 5, 6, 2, 1, 3)
    state = add(state, request("y", tuple(range(300, 311)), 8))
    state, out, _ = step(state)
    assert out.scheduled_new_reqs[0].block_ids == (4, 5, 6)
    state = add(state, request("z", (*x_prompt, 400, 401, 402, 403), 1))
    _, out = schedule(state)
    (z,) = out.scheduled_new_reqs
    assert z.block_ids[:2] == (1, 2) and z.num_computed_tokens == 8
    assert out.num_scheduled_tokens["z"] == 4


@pytest.mark.parametrize(("prompt", "admitted"), [(14, True), (15, False)])
def test_chunked_prefill_off_prompt_at_the_budget_boundary(prompt, admitted):
    """With chunked prefill off a prompt runs whole or waits: two decodes leave 14 of the 16
    budget tokens, so a 14-token prompt runs this step and a 15-token one waits, holding up the
    small request behind it too (vLLM stops at the first waiting request that does not fit)."""
    state = make(
        enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=16, num_blocks=33
    )
    state, _, _ = step(add(state, request("a", 4, 8), request("b", 4, 8)))
    state = add(state, request("c", prompt, 1), request("d", 2, 1))
    state, out = schedule(state)
    expected = {"a": 1, "b": 1, "c": 14} if admitted else {"a": 1, "b": 1}
    assert dict(out.num_scheduled_tokens) == expected
    assert state.waiting == (("d",) if admitted else ("c", "d"))


@pytest.mark.parametrize(("other_prompt", "admitted"), [(2, True), (5, False)])
def test_whole_sequence_reservation_counts_revived_prefix_blocks(other_prompt, admitted):
    """z's first 8 tokens hit x's two cached blocks, which are free (ref count 0): touching them
    takes them off the free list, so admitting z's 16 tokens needs 4 free blocks (2 new + 2
    revived), not 2, although its first chunk (4 tokens, long_prefill_token_threshold) fits in 3.
    r holds 1 block (4 left free: admitted) or 2 (3 left: z waits)."""
    x_prompt = tuple(range(100, 108))
    state = make(
        num_blocks=6, max_model_len=20, max_num_batched_tokens=32, long_prefill_token_threshold=4
    )
    state, _, _ = step(add(state, request("x", x_prompt, 1)))  # alone: no cap; finishes
    state, _, _ = step(add(state, request("r", other_prompt, 5)))
    assert state.running == ("r",) and len(kvc.blocks_of(state.kv, "r")) == other_prompt // 4 + 1
    assert [bp.ref_count(state.kv.pool, b) for b in (1, 2)] == [0, 0]
    assert kvc.num_free_blocks(state.kv) == (4 if admitted else 3)
    state = add(state, request("z", (*x_prompt, *range(500, 508)), 1))
    state, out = schedule(state)
    if admitted:
        (z,) = out.scheduled_new_reqs
        assert z.num_computed_tokens == 8 and z.block_ids[:2] == (1, 2)
        assert out.num_scheduled_tokens["z"] == 4
    else:
        assert not out.scheduled_new_reqs and state.waiting == ("z",)
    assert out.num_scheduled_tokens["r"] == 1


def test_requests_finishing_together_free_their_blocks_in_admission_order():
    """p (least urgent) is preempted; n, more urgent, arrives and both are admitted in one step,
    n first, and both finish in it. vLLM frees finished requests in scheduling order (n, then p),
    so p's unhashed last block ends up ahead of n's in the free queue. vlax used to free in batch
    order (resumed requests before new ones), which put n's block first."""
    state = make(num_blocks=7, max_model_len=20, max_num_batched_tokens=32, policy="priority")
    state = add(
        state,
        request("p", 5, 3, priority=1, arrival=0.0),
        request("h", 7, 20, priority=0, arrival=1.0),
        request("f", 6, 3, priority=0, arrival=2.0),
    )
    for _ in range(3):
        state, out, _ = step(state)
    assert out.preempted_req_ids == ("p",) and state.waiting == ("p",)
    state = add(state, request("n", 3, 1, priority=0, arrival=3.0))
    state, out, outputs = step(state)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["n"]
    assert [c.req_id for c in out.scheduled_cached_reqs if c.resumed_from_preemption] == ["p"]
    assert state.running == ("h",) and {o.req_id for o in outputs if o.finished} == {"n", "p"}
    # n held block 5; p held 4 (full, hashed) and 3 (partial): freed n, then p.
    assert bp.free_order(state.kv.pool) == (3, 5, 4)
