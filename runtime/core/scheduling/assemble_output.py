"""The output of a planned step: `schedule` (plan_step.py) decides in a scratch accumulator; this
builds the SchedulerOutput it sends to the runner (new and cached request deltas, scheduled
tokens, encoder work, state slots) and the scheduler state after the step, with the step's
in-flight entries under async scheduling."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.core.encoder import encoder_cache as ec
from runtime.core.outputs import (
    EMPTY_MAPPING,
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
    frozen_mapping,
)
from runtime.core.scheduling.encoder_scheduling import assign_encoder_work
from runtime.core.scheduling.scheduler_state import SchedulerState, evolve_state

if TYPE_CHECKING:
    from runtime.core.scheduling.plan_step import _Step

__all__ = ["assemble_output"]


def assemble_output(state: SchedulerState, step: _Step) -> tuple[SchedulerState, SchedulerOutput]:
    """The step's SchedulerOutput and the state after it, from what `schedule` decided."""
    encoder, to_compute, to_free = ec.end_step(step.encoder)
    kv = step.kv
    cached, new = [], []
    num_scheduled = dict(step.num_scheduled)
    # One delta per running request, every step: built positionally (req_id,
    # resumed_from_preemption, new_block_ids, num_computed_tokens, all_token_ids,
    # num_output_tokens), since keyword construction costs more than the rest of the loop.
    changed, base, new_blocks = step.changed, step.base, step.new_blocks
    if step.in_flight is None:
        for request_id in step.num_scheduled:
            request = changed.get(request_id) or base[request_id]
            cached.append(
                CachedRequestData(
                    request_id,
                    False,
                    new_blocks[request_id],
                    request.num_computed_tokens,
                    None,
                    len(request.output_token_ids),
                )
            )
    else:
        # Positions and output counts include the steps in flight (vLLM reports the advanced
        # num_computed_tokens and num_output_tokens + num_output_placeholders).
        computed_of = step.computed
        for request_id in step.num_scheduled:
            request = changed.get(request_id) or base[request_id]
            computed, placeholders = computed_of[request_id]
            cached.append(
                CachedRequestData(
                    request_id,
                    False,
                    new_blocks[request_id],
                    computed,
                    None,
                    len(request.output_token_ids) + placeholders,
                )
            )
    for request_id, resumed, num_tokens in step.admitted:
        request = step.get(request_id)
        table = kv.tables[request_id]
        if resumed:
            cached.append(
                CachedRequestData(
                    req_id=request_id,
                    resumed_from_preemption=True,
                    new_block_ids=table,
                    num_computed_tokens=request.num_computed_tokens,
                    all_token_ids=request.all_token_ids,
                    num_output_tokens=len(request.output_token_ids),
                )
            )
            num_scheduled[request_id] = num_tokens
    for request_id, resumed, num_tokens in step.admitted:
        if resumed:
            continue
        request = step.get(request_id)
        new.append(
            NewRequestData(
                req_id=request_id,
                prompt_token_ids=request.prompt_token_ids,
                mm_inputs=request.mm_inputs,
                sampling_params=request.sampling_params,
                block_ids=kv.tables[request_id],
                num_computed_tokens=request.num_computed_tokens,
                lora_name=request.lora_name,
                eos_token_ids=request.eos_token_ids,
                pooling_params=request.pooling_params,
            )
        )
        num_scheduled[request_id] = num_tokens
    if step.slots is None:
        state_slots, reset_state_slots = EMPTY_MAPPING, ()
    else:
        owners = step.slots.owners
        state_slots = frozen_mapping(
            {request_id: owners[request_id] for request_id in num_scheduled}
        )
        # Every admitted request starts its state from zero: a new one, and a resumed one, which
        # recomputes from token 0 (prefix caching is off with state slots).
        reset_state_slots = tuple(sorted(owners[request_id] for request_id, _, _ in step.admitted))
    output = SchedulerOutput(
        step=state.step,
        scheduled_new_reqs=tuple(new),
        scheduled_cached_reqs=tuple(cached),
        num_scheduled_tokens=frozen_mapping(num_scheduled),
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_encoder_inputs=assign_encoder_work(encoder, to_compute, num_scheduled),
        free_encoder_hashes=to_free,
        preempted_req_ids=tuple(step.preempted),
        finished_req_ids=state.finished_since_last,
        state_slots=state_slots,
        reset_state_slots=reset_state_slots,
    )
    in_flight = state.in_flight
    if step.in_flight is not None:
        in_flight = _record_in_flight(step, state.step, num_scheduled)
    requests = state.requests
    if step.changed:
        with requests.mutate() as mutable:
            for request_id, request in step.changed.items():
                mutable[request_id] = request
            requests = mutable.finish()
    new_state = evolve_state(
        state,
        kv=kv,
        encoder=encoder,
        requests=requests,
        waiting=step.waiting,
        running=tuple(step.running),
        step=state.step + 1,
        finished_since_last=(),
        awaiting_update=state.step if state.awaiting_update is None else state.awaiting_update,
        kv_jobs=step.jobs,
        state_slots=step.slots,
        in_flight=in_flight,
    )
    return new_state, output


def _record_in_flight(step: _Step, step_number: int, num_scheduled: dict[str, int]):
    """Async scheduling: each scheduled request gains this step as in flight; it samples when
    it computes every known token and placeholder (not a prefill chunk), unless it pools."""
    changed, base, computed_of = step.changed, step.base, step.computed
    with step.in_flight.mutate() as mutable:
        for request_id, num_tokens in num_scheduled.items():
            request = changed.get(request_id) or base[request_id]
            entries = mutable.get(request_id, ())
            computed, placeholders = computed_of.get(request_id, (request.num_computed_tokens, 0))
            samples = request.pooling_params is None and (
                computed + num_tokens >= request.num_tokens + placeholders
            )
            mutable[request_id] = (*entries, (step_number, num_tokens, samples, False))
        return mutable.finish()
