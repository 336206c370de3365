"""The scheduler's public API: pure transitions over an immutable `SchedulerState`.

    state = make_scheduler(config)
    state = add_request(state, request)
    state, out = schedule(state)              # what the runner computes this step
    state, outputs = update(state, out, mro)  # apply the runner's results; stop checks

Every call returns new values and leaves its inputs as they were, so any step's state can be kept,
compared and replayed. Misuse raises `SchedulerError` naming the bad value.
"""

from collections.abc import Iterable

from runtime.core.kv import kv_cache as kvc
from runtime.core.request import FinishReason, Request, RequestStatus, evolve
from runtime.core.scheduling.apply_output import remove_finished, update
from runtime.core.scheduling.plan_step import schedule
from runtime.core.scheduling.scheduler_config import SchedulerConfig, SchedulerConfigError
from runtime.core.scheduling.scheduler_state import (
    SchedulerError,
    SchedulerState,
    evolve_state,
    hash_extras,
    make_scheduler,
    with_waiting,
)

__all__ = [
    "SchedulerConfig",
    "SchedulerConfigError",
    "SchedulerError",
    "SchedulerState",
    "abort_requests",
    "add_request",
    "finish_requests",
    "has_request",
    "has_unfinished_requests",
    "make_scheduler",
    "schedule",
    "update",
]

_FINISHED_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH_CAPPED,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


def add_request(state: SchedulerState, request: Request) -> SchedulerState:
    """Queue a fresh request (FCFS: at the back; priority: by priority, arrival, id)."""
    if not isinstance(request, Request):
        raise SchedulerError(f"add_request: {request!r} is not a Request")
    request_id = request.request_id
    if request_id in state.requests:
        raise SchedulerError(
            f"add_request: request id {request_id!r} is in use by an unfinished request"
        )
    if (
        request.status is not RequestStatus.WAITING
        or request.output_token_ids
        or request.num_computed_tokens
        or request.num_preemptions
        or request.block_hashes
        or request.finish_reason is not None
    ):
        raise SchedulerError(
            f"add_request({request_id!r}): expected a fresh request (status WAITING, no output "
            f"tokens, nothing computed or hashed), got status {request.status.name} with "
            f"{request.num_output_tokens} output and {request.num_computed_tokens} computed tokens"
        )
    config = state.config
    num_prompt = request.num_prompt_tokens
    if request.pooling_params is not None:
        # Prefill-only: a pooling prompt may fill max_model_len, as nothing is generated.
        if num_prompt > config.max_model_len:
            raise SchedulerError(
                f"add_request({request_id!r}): pooling prompt of {num_prompt} tokens is longer "
                f"than max_model_len={config.max_model_len}"
            )
    elif num_prompt >= config.max_model_len:
        raise SchedulerError(
            f"add_request({request_id!r}): prompt of {num_prompt} tokens leaves no "
            f"room to generate within max_model_len={config.max_model_len}"
        )
    for item in request.mm_inputs:
        limit = min(config.encoder_cache_size, config.encoder_compute_budget)
        if item.num_embeds > limit:
            raise SchedulerError(
                f"add_request({request_id!r}): multimodal input {item.content_hash!r} has "
                f"{item.num_embeds} embeddings, more than encoder_cache_size="
                f"{config.encoder_cache_size} / encoder_compute_budget="
                f"{config.encoder_compute_budget}; it could never be encoded"
            )
    if config.enable_prefix_caching:
        hashes = kvc.extend_block_hashes(
            (), request.prompt_token_ids, config.block_size, hash_extras(request)
        )
        request = evolve(request, block_hashes=hashes)
    requests = state.requests.set(request_id, request)
    return evolve_state(
        state,
        requests=requests,
        waiting=with_waiting(state.waiting, requests, request_id, config.policy, front=False),
    )


def finish_requests(
    state: SchedulerState, request_ids: Iterable[str], reason: FinishReason
) -> SchedulerState:
    """Finish unfinished requests from outside (abort; stop strings found by the output processor;
    errors the shell met serving them), releasing everything they hold. Unknown or repeated ids
    raise and change nothing."""
    if reason not in _FINISHED_STATUS:
        raise SchedulerError(f"finish_requests: reason={reason!r}, expected a FinishReason")
    request_ids = tuple(request_ids)
    if len(set(request_ids)) != len(request_ids):
        raise SchedulerError(f"finish_requests: repeated ids in {request_ids}")
    unknown = [rid for rid in request_ids if rid not in state.requests]
    if unknown:
        raise SchedulerError(
            f"finish_requests: no unfinished request has id {unknown[0]!r} "
            f"(finished already, or never added)"
        )
    status = _FINISHED_STATUS[reason]
    finished = [
        evolve(state.requests[rid], status=status, finish_reason=reason) for rid in request_ids
    ]
    return remove_finished(state, finished)


def abort_requests(state: SchedulerState, request_ids: Iterable[str]) -> SchedulerState:
    return finish_requests(state, request_ids, FinishReason.ABORT)


def has_request(state: SchedulerState, request_id: str) -> bool:
    return request_id in state.requests


def has_unfinished_requests(state: SchedulerState) -> bool:
    return len(state.requests) > 0
