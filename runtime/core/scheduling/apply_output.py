"""update(state, scheduler_output, model_runner_output) -> (state, outputs): apply one step.

Each scheduled request's computed count advances by its scheduled tokens; a request that caught
up with its tokens gets its sampled token appended and its stop conditions checked. Finished
requests release their blocks, state slots and encoder references and leave the state.

Async scheduling (runtime/core/scheduling/in_flight.py): the step's entry leaves each request's
steps in flight; a request whose lifecycle ended after the step was planned (finished, aborted)
holds no entry for it and is passed over; one preempted since gets its token delivered without
advancing its computed count; a running request's newly full blocks are cached as its token
arrives (vLLM's AsyncScheduler caches them in update_from_output).
"""

from collections.abc import Sequence

from runtime.core.kv import kv_cache as kvc
from runtime.core.kv_jobs.scheduler_hooks import apply_kv_job_results, detach_finished
from runtime.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from runtime.core.request import Request, evolve
from runtime.core.scheduling.scheduler_state import (
    SchedulerError,
    SchedulerState,
    evolve_state,
    hash_extras,
    release_request_inputs,
)
from runtime.core.scheduling.stop import POOLED, check_stop
from runtime.core.state import state_slots as ss

__all__ = ["remove_finished", "update"]


def update(
    state: SchedulerState,
    scheduler_output: SchedulerOutput,
    runner_output: ModelRunnerOutput,
    kv_job_results: tuple = (),
) -> tuple[SchedulerState, tuple[EngineCoreOutput, ...]]:
    """`kv_job_results`: the `KVJobResult`s of KV jobs that ended since the last update."""
    _check_step(state, scheduler_output, runner_output)
    step = scheduler_output.step
    scheduled = scheduler_output.num_scheduled_tokens
    row_of = {rid: row for row, rid in enumerate(runner_output.req_ids)}
    # Requests that finished or were aborted after this output was made: their lifecycle ended,
    # and a request now holding the same id was not scheduled by it.
    ended = frozenset(state.finished_since_last)
    config = state.config
    max_model_len = config.max_model_len
    block_size = config.block_size
    hashing = config.enable_prefix_caching
    requests = state.requests
    sampled_rows = runner_output.sampled_token_ids
    logprob_rows = runner_output.logprobs
    prompt_logprobs = runner_output.prompt_logprobs
    pooler_rows = runner_output.pooler_output
    encoder = state.encoder
    async_mode = config.async_scheduling
    in_flight = state.in_flight
    if async_mode:
        in_flight = in_flight.mutate()
    kv = state.kv
    changed: dict[str, Request] = {}
    finished: list[Request] = []
    outputs = []
    for request_id, num_tokens in scheduled.items():
        if request_id in ended:
            continue
        stale = False
        if async_mode:
            entries = in_flight.get(request_id)
            if not entries or entries[0][0] != step:
                # Its lifecycle ended after this step was planned; the id may name a new request.
                continue
            stale = entries[0][3]
            if len(entries) > 1:
                in_flight[request_id] = entries[1:]
            else:
                del in_flight[request_id]
        request = requests.get(request_id)
        row = row_of.get(request_id)
        if request is None or row is None:
            missing = (
                "is unknown to the state"
                if request is None
                else "is missing from the runner output"
            )
            raise SchedulerError(
                f"update(step {step}): request {request_id!r} was scheduled but {missing}"
            )
        sampled = sampled_rows[row]
        if stale:
            new, new_ids, stop = _deliver_stale(request, sampled, step, config)
            if stop is not None:
                finished.append(new)
            elif new is not request:
                changed[request_id] = new
            if new_ids:
                outputs.append(
                    EngineCoreOutput(
                        request_id,
                        new_ids,
                        new.finish_reason,
                        new.stop_reason,
                        None if logprob_rows is None else logprob_rows[row],
                    )
                )
            continue
        computed = request.num_computed_tokens + num_tokens
        output_ids = request.output_token_ids
        total = len(request.prompt_token_ids) + len(output_ids)
        pooled = None
        if computed < total:
            if sampled or (pooler_rows is not None and pooler_rows[row] is not None):
                raise SchedulerError(
                    f"update(step {step}): request {request_id!r} is mid-prefill "
                    f"({computed} of {total} tokens) but the runner sampled {sampled} or "
                    "pooled it"
                )
            new = evolve(request, num_computed_tokens=computed)
            new_ids = ()
            stop = None
        elif request.pooling_params is not None:
            # Prefill-only: the step that computes the last prompt token pools it, and the
            # request finishes in that step (vLLM: FINISHED_STOPPED once pooler output exists).
            pooled = _pooled(step, request_id, sampled, pooler_rows, row)
            new = evolve(request, num_computed_tokens=computed)
            new_ids = ()
            stop = POOLED
        else:
            new_ids = _one_token(step, request_id, sampled)
            output_ids = output_ids + new_ids
            hashes = request.block_hashes
            if hashing and (total + 1) // block_size > len(hashes):
                hashes = kvc.extend_block_hashes(
                    hashes,
                    _Tokens(request.prompt_token_ids, output_ids),
                    block_size,
                    hash_extras(request),
                )
            new = evolve(
                request,
                output_token_ids=output_ids,
                num_computed_tokens=computed,
                block_hashes=hashes,
            )
            stop = check_stop(new, max_model_len)
            if async_mode and hashing and len(hashes) > kv.num_cached.get(request_id, 0):
                # Cache the blocks its token completed now, as vLLM's AsyncScheduler does, not
                # at its next allocation (a request admitted before then could hit them).
                kv = kvc.allocate_slots(kv, request_id, 0, computed, block_hashes=hashes).state
        if new.mm_inputs:
            encoder = release_request_inputs(encoder, new, upto=computed)
        if stop is not None:
            new = evolve(
                new, status=stop.status, finish_reason=stop.reason, stop_reason=stop.stop_reason
            )
            finished.append(new)
        else:
            changed[request_id] = new
        prompt_entry = None if prompt_logprobs is None else prompt_logprobs.get(request_id)
        if new_ids or prompt_entry is not None or pooled is not None:
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    new_ids,
                    new.finish_reason,
                    new.stop_reason,
                    None if logprob_rows is None else logprob_rows[row],
                    prompt_entry,
                    pooled,
                )
            )
    if changed:
        with requests.mutate() as mutable:
            for request_id, request in changed.items():
                mutable[request_id] = request
            requests = mutable.finish()
    awaiting = None
    if async_mode:
        in_flight = in_flight.finish()
        if step + 1 < state.step:
            awaiting = step + 1
    new_state = evolve_state(
        state,
        kv=kv,
        encoder=encoder,
        requests=requests,
        awaiting_update=awaiting,
        in_flight=in_flight,
    )
    new_state = apply_kv_job_results(new_state, tuple(kv_job_results))
    if len(finished) > 1:
        # vLLM frees finished requests in the order it scheduled them: running ones, then those
        # admitted this step in admission order, which is their order in `running` (the batch
        # puts resumed requests before new ones). The order decides the free queue's order.
        position = {request_id: index for index, request_id in enumerate(state.running)}
        finished.sort(key=lambda request: position.get(request.request_id, len(position)))
    return remove_finished(new_state, finished), tuple(outputs)


def _deliver_stale(
    request: Request, sampled: tuple, step: int, config
) -> tuple[Request, tuple[int, ...], object]:
    """A step planned before the request was preempted: its token (if it sampled one) is still
    the request's next token, so it is appended and stop-checked, but the computed count stays
    where the preemption put it (vLLM: stale output is delivered without touching counters)."""
    if not sampled:
        return request, (), None
    new_ids = _one_token(step, request.request_id, sampled)
    output_ids = request.output_token_ids + new_ids
    hashes = request.block_hashes
    if config.enable_prefix_caching and (request.num_tokens + 1) // config.block_size > len(hashes):
        hashes = kvc.extend_block_hashes(
            hashes,
            _Tokens(request.prompt_token_ids, output_ids),
            config.block_size,
            hash_extras(request),
        )
    new = evolve(request, output_token_ids=output_ids, block_hashes=hashes)
    stop = check_stop(new, config.max_model_len)
    if stop is not None:
        new = evolve(
            new, status=stop.status, finish_reason=stop.reason, stop_reason=stop.stop_reason
        )
    return new, new_ids, stop


def _pooled(step: int, request_id: str, sampled: tuple, pooler_rows, row: int) -> object:
    pooled = None if pooler_rows is None else pooler_rows[row]
    if sampled or pooled is None:
        raise SchedulerError(
            f"update(step {step}): pooling request {request_id!r} computed its whole prompt and "
            f"expects its pooled output and no sampled token, got sampled={sampled!r} and "
            f"{'no' if pooled is None else 'a'} pooled output"
        )
    return pooled


def _one_token(step: int, request_id: str, sampled: tuple[int, ...]) -> tuple[int, ...]:
    if len(sampled) != 1:
        raise SchedulerError(
            f"update(step {step}): request {request_id!r} computed all its tokens and expects "
            f"exactly one sampled token, got {sampled!r}"
        )
    token = sampled[0]
    if not isinstance(token, int) or token < 0:
        raise SchedulerError(
            f"update(step {step}): request {request_id!r} sampled token {token!r}, expected an "
            "int >= 0"
        )
    return sampled if type(sampled) is tuple else (token,)


class _Tokens(Sequence):
    """prompt + output as one read-only sequence without copying either (hashing the newly
    full block only reads its slice)."""

    __slots__ = ("_prompt", "_output")

    def __init__(self, prompt: tuple[int, ...], output: tuple[int, ...]) -> None:
        self._prompt, self._output = prompt, output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, stride = index.indices(len(self))
            cut = len(self._prompt)
            if stride != 1 or start < cut < stop:
                return (self._prompt + self._output)[index]
            if stop <= cut:
                return self._prompt[start:stop]
            return self._output[start - cut : stop - cut]
        if index < 0:
            index += len(self)
        cut = len(self._prompt)
        return self._prompt[index] if index < cut else self._output[index - cut]


def remove_finished(state: SchedulerState, finished: list[Request]) -> SchedulerState:
    """Drop finished requests from the state, releasing their blocks, state slots and encoder
    references."""
    if not finished:
        return state
    kv, encoder, slots, ids = state.kv, state.encoder, state.state_slots, set()
    for request in finished:
        request_id = request.request_id
        if kvc.has_request(kv, request_id):
            kv = kvc.free(kv, request_id)
        if slots is not None and ss.slot_of(slots, request_id) is not None:
            slots = ss.release(slots, request_id)
        encoder = release_request_inputs(encoder, request)
        ids.add(request_id)
    with state.requests.mutate() as mutable:
        for request_id in ids:
            del mutable[request_id]
        requests = mutable.finish()
    in_flight = state.in_flight
    if in_flight:
        # Their steps in flight are passed over by update() (the id may be reused meanwhile).
        with in_flight.mutate() as mutable:
            for request_id in ids:
                if request_id in mutable:
                    del mutable[request_id]
            in_flight = mutable.finish()
    reported = set(state.finished_since_last)
    return evolve_state(
        state,
        kv=kv,
        encoder=encoder,
        requests=requests,
        waiting=tuple(r for r in state.waiting if r not in ids),
        running=tuple(r for r in state.running if r not in ids),
        finished_since_last=state.finished_since_last
        + tuple(r.request_id for r in finished if r.request_id not in reported),
        kv_jobs=detach_finished(state, ids),
        state_slots=slots,
        in_flight=in_flight,
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
