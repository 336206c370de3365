"""update(state, scheduler_output, model_runner_output) -> (state, outputs): apply one step.

Each scheduled request's computed count advances by its scheduled tokens; a request that caught
up with its tokens gets its sampled token appended and its stop conditions checked. Finished
requests release their blocks and encoder references and leave the state.
"""

from immutables import Map

from runtime.core import kv_cache as kvc
from runtime.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from runtime.core.request import Request, evolve
from runtime.core.scheduler_state import (
    SchedulerError,
    SchedulerState,
    hash_extras,
    release_request_inputs,
)
from runtime.core.stop import check_stop

__all__ = ["remove_finished", "update"]


def update(
    state: SchedulerState, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
) -> tuple[SchedulerState, tuple[EngineCoreOutput, ...]]:
    _check_step(state, scheduler_output, runner_output)
    scheduled = scheduler_output.num_scheduled_tokens
    row_of = {rid: row for row, rid in enumerate(runner_output.req_ids)}
    # Requests that finished or were aborted after this output was made: their lifecycle ended,
    # and a request now holding the same id was not scheduled by it.
    ended = frozenset(state.finished_since_last)
    config = state.config
    block_size = config.block_size
    hashing = config.enable_prefix_caching
    sampled_rows = runner_output.sampled_token_ids
    logprob_rows = runner_output.logprobs
    prompt_logprobs = runner_output.prompt_logprobs or Map()
    encoder = state.encoder
    changed: dict[str, Request] = {}
    finished: list[Request] = []
    outputs = []
    for request_id, num_tokens in scheduled.items():
        if request_id in ended:
            continue
        request = state.requests.get(request_id)
        row = row_of.get(request_id)
        if request is None or row is None:
            raise SchedulerError(
                f"update(step {scheduler_output.step}): request {request_id!r} was scheduled but "
                + (
                    "is unknown to the state"
                    if request is None
                    else "is missing from the runner output"
                )
            )
        sampled = sampled_rows[row]
        computed = request.num_computed_tokens + num_tokens
        if computed < request.num_tokens:
            if sampled:
                raise SchedulerError(
                    f"update(step {scheduler_output.step}): request {request_id!r} is mid-prefill "
                    f"({computed} of {request.num_tokens} tokens) but the runner sampled {sampled}"
                )
            new = evolve(request, num_computed_tokens=computed)
            stop = None
        else:
            if len(sampled) != 1:
                raise SchedulerError(
                    f"update(step {scheduler_output.step}): request {request_id!r} computed all "
                    f"its tokens and expects exactly one sampled token, got {sampled!r}"
                )
            token = sampled[0]
            if not isinstance(token, int) or token < 0:
                raise SchedulerError(
                    f"update(step {scheduler_output.step}): request {request_id!r} sampled "
                    f"token {token!r}, expected an int >= 0"
                )
            output_ids = request.output_token_ids + (token,)
            hashes = request.block_hashes
            if hashing and (request.num_tokens + 1) // block_size > len(hashes):
                hashes = kvc.extend_block_hashes(
                    hashes, request.prompt_token_ids + output_ids, block_size, hash_extras(request)
                )
            new = evolve(
                request,
                output_token_ids=output_ids,
                num_computed_tokens=computed,
                block_hashes=hashes,
            )
            stop = check_stop(new, config.max_model_len)
        if new.mm_inputs:
            encoder = release_request_inputs(encoder, new, upto=computed)
        if stop is not None:
            new = evolve(
                new, status=stop.status, finish_reason=stop.reason, stop_reason=stop.stop_reason
            )
            finished.append(new)
        else:
            changed[request_id] = new
        prompt_entry = prompt_logprobs.get(request_id)
        if new.output_token_ids is not request.output_token_ids or prompt_entry is not None:
            new_ids = new.output_token_ids[request.num_output_tokens :]
            outputs.append(
                EngineCoreOutput(
                    req_id=request_id,
                    new_token_ids=new_ids,
                    finish_reason=new.finish_reason,
                    stop_reason=new.stop_reason,
                    new_logprobs=None if logprob_rows is None else logprob_rows[row],
                    new_prompt_logprobs=prompt_entry,
                )
            )
    requests = state.requests
    if changed:
        with requests.mutate() as mutable:
            for request_id, request in changed.items():
                mutable[request_id] = request
            requests = mutable.finish()
    new_state = SchedulerState(
        config=config,
        kv=state.kv,
        encoder=encoder,
        requests=requests,
        waiting=state.waiting,
        running=state.running,
        step=state.step,
        finished_since_last=state.finished_since_last,
        awaiting_update=None,
    )
    return remove_finished(new_state, finished), tuple(outputs)


def remove_finished(state: SchedulerState, finished: list[Request]) -> SchedulerState:
    """Drop finished requests from the state, releasing their blocks and encoder references."""
    if not finished:
        return state
    kv, encoder, ids = state.kv, state.encoder, set()
    for request in finished:
        request_id = request.request_id
        if kvc.has_request(kv, request_id):
            kv = kvc.free(kv, request_id)
        encoder = release_request_inputs(encoder, request)
        ids.add(request_id)
    with state.requests.mutate() as mutable:
        for request_id in ids:
            del mutable[request_id]
        requests = mutable.finish()
    reported = set(state.finished_since_last)
    return SchedulerState(
        config=state.config,
        kv=kv,
        encoder=encoder,
        requests=requests,
        waiting=tuple(r for r in state.waiting if r not in ids),
        running=tuple(r for r in state.running if r not in ids),
        step=state.step,
        finished_since_last=state.finished_since_last
        + tuple(r.request_id for r in finished if r.request_id not in reported),
        awaiting_update=state.awaiting_update,
    )


def _check_step(
    state: SchedulerState, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
) -> None:
    if not isinstance(scheduler_output, SchedulerOutput) or not isinstance(
        runner_output, ModelRunnerOutput
    ):
        raise SchedulerError(
            f"update: expected a SchedulerOutput and a ModelRunnerOutput, got "
            f"{type(scheduler_output).__name__} and {type(runner_output).__name__}"
        )
    if state.awaiting_update != scheduler_output.step:
        expected = (
            "no step (nothing was scheduled since the last update)"
            if state.awaiting_update is None
            else f"step {state.awaiting_update}"
        )
        raise SchedulerError(
            f"update: got the output of step {scheduler_output.step}, but the state awaits "
            f"{expected}; each schedule() output is applied exactly once, in order"
        )
    scheduled = scheduler_output.num_scheduled_tokens
    extra = [rid for rid in runner_output.req_ids if rid not in scheduled]
    if extra:
        raise SchedulerError(
            f"update(step {scheduler_output.step}): runner output holds requests {extra} that "
            "this step did not schedule"
        )
