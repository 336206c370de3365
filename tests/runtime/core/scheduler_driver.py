"""Helpers that drive the scheduler with synthetic runner outputs and check every step."""

from dataclasses import replace

from runtime.core import scheduler as sch
from runtime.core.devtools.synthetic_runner import (
    ZERO_STATE,
    absorb,
    counting_token,
    make_slot_states,
    recurrent_runner_output,
    runner_output,
    state_token,
)
from runtime.core.request import MultiModalInput, Request, SamplingParams
from runtime.core.scheduling.scheduler_invariants import check_output, check_state

DEFAULTS = {
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
    "max_model_len": 64,
    "block_size": 4,
    "num_blocks": 33,
}


def make(**overrides) -> sch.SchedulerState:
    return sch.make_scheduler(sch.SchedulerConfig(**{**DEFAULTS, **overrides}))


def request(
    request_id: str,
    prompt: int | tuple[int, ...],
    max_tokens: int | None = 4,
    *,
    mm: tuple[MultiModalInput, ...] = (),
    arrival: float = 0.0,
    priority: int = 0,
    eos: int | None = None,
    **params,
) -> Request:
    """A request whose prompt is `prompt` token ids, or that many ids derived from its id."""
    if isinstance(prompt, int):
        base = sum(map(ord, request_id)) * 101
        prompt = tuple((base + i) % 997 + 3 for i in range(prompt))
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=() if eos is None else (eos,),
        arrival_time=arrival,
        priority=priority,
        mm_inputs=mm,
    )


def add(state, *requests):
    for r in requests:
        state = sch.add_request(state, r)
        check_state(state)
    return state


def schedule(state):
    """schedule() with the state and output invariants checked."""
    after, out = sch.schedule(state)
    check_state(after)
    check_output(state, after, out)
    return after, out


def step(state, token_for=counting_token):
    """schedule + synthetic runner + update; returns (state, output, engine outputs)."""
    scheduled, out = schedule(state)
    state, outputs = sch.update(scheduled, out, runner_output(scheduled, out, token_for))
    check_state(state)
    return state, out, outputs


def run(state, max_steps=200, token_for=counting_token):
    """Step until nothing is unfinished; returns (state, [outputs], {req: (tokens, reason)})."""
    outs, results = [], {}
    for _ in range(max_steps):
        if not sch.has_unfinished_requests(state):
            return state, outs, results
        state, out, engine_outputs = step(state, token_for)
        outs.append(out)
        for o in engine_outputs:
            tokens, _ = results.get(o.req_id, ((), None))
            results[o.req_id] = (tokens + o.new_token_ids, o.finish_reason)
    raise AssertionError(f"not finished after {max_steps} steps: {state}")


def tokens_per_step(outs):
    return [dict(o.num_scheduled_tokens) for o in outs]


def hybrid_step(state, slot_states, *, honour_resets=True):
    """step() for a hybrid model: the synthetic recurrent runner computes every request from the
    state in its slot. `honour_resets=False` plays a runner that skips the zeroing (to show that
    a scenario needs it). Returns (state, slot states, output, engine outputs)."""
    scheduled, out = schedule(state)
    seen = out if honour_resets else replace(out, reset_state_slots=())
    slot_states, runner = recurrent_runner_output(slot_states, scheduled, seen)
    state, outputs = sch.update(scheduled, out, runner)
    check_state(state)
    return state, slot_states, out, outputs


def hybrid_run(state, slot_states=None, max_steps=200, *, honour_resets=True):
    """run() for a hybrid model; returns (state, slot states, [outputs], {req: tokens})."""
    if slot_states is None:
        slot_states = make_slot_states(state.config.num_state_slots)
    outs, tokens = [], {}
    for _ in range(max_steps):
        if not sch.has_unfinished_requests(state):
            return state, slot_states, outs, tokens
        state, slot_states, out, engine_outputs = hybrid_step(
            state, slot_states, honour_resets=honour_resets
        )
        outs.append(out)
        for o in engine_outputs:
            tokens[o.req_id] = tokens.get(o.req_id, ()) + o.new_token_ids
    raise AssertionError(f"not finished after {max_steps} steps: {state}")


def hybrid_alone(request, max_model_len):
    """The tokens the synthetic recurrent model gives `request` run alone from a zero state
    (no EOS: it stops at max_tokens or max_model_len)."""
    state, out = absorb(ZERO_STATE, request.prompt_token_ids), ()
    while True:
        out += (state_token(state),)
        total = request.num_prompt_tokens + len(out)
        if len(out) >= request.sampling_params.max_tokens or total >= max_model_len:
            return out
        state = absorb(state, out[-1:])
